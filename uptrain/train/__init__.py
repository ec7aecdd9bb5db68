"""The uptraining job: continue pre-training a (converted) checkpoint with accelerate.

Modules: config (dataclasses + YAML), plan/ (the run plan: every check of the config, the launch
and the run folder, made once into one immutable `Plan`), setup (what is built before step 1 from
the plan: data, optimizer), losses, run_state (checkpoints), loop (the run itself), report
(metrics, plots, the final model folder); __main__ is the CLI.

Python API: `from uptrain.train import train`.
"""

__all__ = ["train"]


def __getattr__(name: str):
    # Lazy, like uptrain.convert: `uptrain.train.config` etc. import without the loop's deps.
    if name == "train":
        from uptrain.train.loop import train

        return train
    raise AttributeError(f"module 'uptrain.train' has no attribute {name!r}")
