"""The conversion's checkpoint I/O, no tensor math: reading local or Hub checkpoints (`source`),
the tensors kept byte for byte (`passthrough`), the streaming shard writer (`shards`), the
all-or-nothing output folder (`output_dir`) and config.json read and patched (`hfconfig`).
Imports only `registry`; `passthrough`, `shards` and `output_dir` are standard library only, so the
CLI starts copying before torch loads."""
