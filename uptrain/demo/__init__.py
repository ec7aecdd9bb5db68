"""`python -m uptrain.demo`: the whole job on the embedded tiny model, end to end on CPU.

Converts the real pretrained stories260K Llama in MHA form (8 K/V heads, `examples/`) to 2 K/V
heads (by default with `--method fit` calibrated on the training sample, then layer-wise
reconstruction of each attention layer, `--refine`; `--method mean --refine-steps 0` is the
paper's pooling), uptrains it on TinyStories text with `configs/demo-cpu.yaml` (by default
distilling from the MHA source), and prints the held-out loss before conversion, after
conversion and after uptraining, with the KV cache.

Your own model and text, same steps and table:

    python -m uptrain.demo --model DIR_OR_HUB_ID --data FILE [--kv-heads N] [optim.lr=X budget.tokens=N]

FILE is read as the trainer reads it (.txt: a blank line between documents; .jsonl/.json/.parquet:
a `text` field); its last tenth of documents is held out for the table (or `--valid FILE`), the
rest is the training text (also the calibration text of `--method fit`). `--kv-heads` defaults
to a quarter of the model's K/V heads. The uptraining is the one recipe the sweep uses too
(`uptrain/train/recipe.py`: peak lr 3e-4, pure distillation from the source); 1/3 of your model's
own pre-training peak is the better lr where you know it: pass `optim.lr=` from its model card, or
measure with `scripts/lr_sweep.py`.
"""

AS_IT_WAS = "nothing was written yet"  # each step says what a stop keeps (`run._keeps`)

# Inside this room: `record.py` (the finished steps a rerun keeps, keyed by what made them, stdlib
# only), `run.py` (the command), `__main__.py` (`python -m uptrain.demo`). This file stays stdlib
# only: the console script `uptrain-demo` imports it first and installs the stop handling before
# torch loads; every other name (`main`, `default_kv_heads`, `CONFIG`, ...) comes from `run.py` on
# first use (PEP 562).
from uptrain.stopping import is_command as _is_command

if _is_command(__name__, "uptrain-demo"):  # the console script: Ctrl-C during the imports ends it cleanly too
    from uptrain.stopping import at_once as _at_once

    _at_once.install("uptrain.demo", AS_IT_WAS)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module("uptrain.demo.run"), name)
