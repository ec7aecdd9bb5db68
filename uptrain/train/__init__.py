"""The uptraining job: continue pre-training a (converted) checkpoint with accelerate.

Modules: config (dataclasses + YAML), sources and packing (text -> token blocks), setup (checks
and everything built before step 1), losses, run_state (checkpoints and resume), loop (the run
itself), report (metrics, plots, the final model folder); __main__ is the CLI.

Python API: `from uptrain.train import train`.
"""

__all__ = ["train"]


def __getattr__(name: str):
    # Lazy: `python -m uptrain.train --help` and config checks need no torch/transformers import.
    if name == "train":
        from uptrain.train.loop import train

        return train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
