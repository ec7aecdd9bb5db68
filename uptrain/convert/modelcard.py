"""The model card (README.md) of a converted checkpoint."""

from __future__ import annotations

from uptrain.convert.plan import ConversionPlan, format_plan

_METHODS = {
    "mean": "mean-pooling the K/V projection heads of each group of query heads (the GQA paper's method)",
    "first": "keeping the first K/V head of each group (the GQA paper's 'first' ablation)",
    "random": "re-initialising the K/V projections at random (the GQA paper's 'random' ablation)",
    "fit": "a least-squares fit of one K/V head per group, with per-head key scales folded into the query "
           "projection and the output projection refitted (uptrain's `--method fit`)",
}


_UNCHANGED = "Query and output projections are unchanged."
_CHANGED = "Query and output projections are changed too (head order and/or fitted compensation)."


def render_model_card(plan: ConversionPlan) -> str:
    """Markdown that says what was done, with the plan table and how to use the result."""
    d = plan.dims
    return f"""---
library_name: transformers
tags: [gqa, uptrain]
---
# {plan.source.rstrip('/').split('/')[-1]} with {plan.new_kv_heads} K/V heads (GQA)

Converted by uptrain {plan.record()['uptrain_version']} from `{plan.source}`
by {_METHODS[plan.method]}: {d.heads} query heads share {plan.new_kv_heads} K/V heads
(was {d.kv_heads}) in each of {d.layers} layers. {_UNCHANGED if plan.method != "fit" and plan.grouping == "contiguous" else _CHANGED}
KV cache per token: {plan.kv_reduction:.1f}x smaller.

```
{format_plan(plan)}
```

Grouped-query attention after Ainslie et al. 2023, "GQA: Training Generalized Multi-Query
Transformer Models from Multi-Head Checkpoints". A converted model loses some quality until it
is uptrained (continued pre-training, the paper uses 5% of the original steps): see
`python -m uptrain.train`. The machine-readable record is `uptrain_conversion.json`.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")
```
"""
