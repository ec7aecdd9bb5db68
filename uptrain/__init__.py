"""uptrain: convert multi-head-attention checkpoints to grouped-query attention and uptrain them."""

__version__ = "0.1.0"
