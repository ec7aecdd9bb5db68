"""The uptraining job: continue pre-training a (converted) checkpoint with accelerate.

Top: config (dataclasses + YAML), setup (what is built before step 1 from the plan: data,
optimizer), loop (the run itself), steps (the loop's body); __main__ is the CLI. Rooms, from the
ground up: stop/ (stop signals, the grace, the finite check), state/ (the run folder, its
metrics log, checkpoints written and loaded), plan/ (the run plan: every check of the
config, the launch and the run folder, made once into one immutable `Plan`), model/ (trainable
parameters, losses, validation, teacher samples), parallel/ (the accelerator, FSDP2), report/
(plots, the final model folder, ETA, MFU).

Python API: `from uptrain.train import train`.
"""

__all__ = ["train"]


def __getattr__(name: str):
    # Lazy, like uptrain.convert: `uptrain.train.config` etc. import without the loop's deps.
    if name == "train":
        from uptrain.train.loop import train

        return train
    raise AttributeError(f"module 'uptrain.train' has no attribute {name!r}")
