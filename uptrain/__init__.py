"""uptrain: MHA -> GQA conversion of Hugging Face checkpoints, uptraining, and measuring the trade."""

import os as _os

__version__ = "0.1.0"

# One progress bar per long step, ours: the libraries' own bars (weights loading, shard writing,
# dataset maps, downloads) are off unless the user asks for them by setting these to 0.
for _var in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
    _os.environ.setdefault(_var, "1")
