"""How the model is spread over processes when the trainer shards it itself (shard.py: FSDP2, its
gradient sync, clipping and sharded checkpoint folders). The accelerator is made in setup.py from
the plan's launch checks. Imports nothing of the trainer."""
