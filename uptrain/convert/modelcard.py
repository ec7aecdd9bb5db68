"""The model card (README.md) of a converted checkpoint.

The source card's YAML front matter (license, language, datasets, tags, gating, ...) is kept,
because a converted model is still bound by the source's licence; its evaluation results
(`model-index`) are dropped, as they describe the source, not the converted model. Added:
`base_model` (the source's Hub id) and `base_model_relation: finetune`. The Hub knows four
relations (adapter, merge, quantized, finetune): this is not an adapter (a full checkpoint),
not a merge (one parent model; the Hub's "merge" combines several), not a quantization (same
dtype, fewer heads); a full set of weights derived from one base model, meant to be trained
further (uptraining), is what the Hub files as a fine-tune.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from uptrain.convert.plan import ConversionPlan, cache_change, format_plan

_METHODS = {
    "mean": "mean-pooling the K/V projection heads of each group of query heads (the GQA paper's method)",
    "first": "keeping the first K/V head of each group (the GQA paper's 'first' ablation)",
    "random": "re-initialising the K/V projections at random (the GQA paper's 'random' ablation)",
    "fit": "a least-squares fit of one K/V head per group (uptrain's `--method fit`): per-head key scales "
           "folded into the query projection and the output projection refitted, or, behind a key norm, "
           "the heads' normalised keys merged with the queries unchanged (the plan's `fit start` note below "
           "says which)",
}
BASE_MODEL_RELATION = "finetune"
_DROPPED = ("model-index", "base_model", "base_model_relation")  # about the source, not this model


_UNCHANGED = "Query and output projections are unchanged."
_CHANGED = "Query and output projections are changed too (head order and/or fitted compensation)."


def _refined(plan: ConversionPlan) -> str:
    """The card's sentence on `--refine` ('' without it)."""
    r = plan.refinement
    if not r or not r.get("layers"):
        return ""
    before = [x["error_before"] for x in r["layers"]]
    after = [x["error_after"] for x in r["layers"]]
    return (f"\nThen each layer's attention weights were refined (Adam, at most {r['steps']} steps per layer, "
            f"lr {r['lr']:g} x weight RMS, {r['inputs']} inputs) to match the original layer's attention output "
            f"on the calibration text: held-out relative error per layer {min(before):.3f}-{max(before):.3f} "
            f"before, {min(after):.3f}-{max(after):.3f} after.")


def source_card_metadata(readme: Path) -> dict[str, Any]:
    """The YAML front matter of a source README.md as a dict ({} when absent or unreadable)."""
    try:
        text = readme.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    if not text.startswith("---"):
        return {}
    parts = text.split("\n---", 1)
    try:
        meta = yaml.safe_load(parts[0].removeprefix("---")) if len(parts) == 2 else None
    except yaml.YAMLError:
        return {}
    return meta if isinstance(meta, dict) else {}


def card_metadata(source_meta: dict[str, Any], base_model: str | None) -> dict[str, Any]:
    """The converted card's front matter: the source's, plus library, tags and the base model."""
    meta = {k: v for k, v in source_meta.items() if k not in _DROPPED}
    meta.setdefault("library_name", "transformers")
    tags = meta.get("tags") or []
    tags = [tags] if isinstance(tags, str) else list(tags)
    meta["tags"] = tags + [t for t in ("gqa", "uptrain") if t not in tags]
    if base_model:  # the relation qualifies a base model; without one it says nothing
        meta["base_model"] = base_model
        meta["base_model_relation"] = BASE_MODEL_RELATION
    return meta


def render_model_card(plan: ConversionPlan, source_meta: dict[str, Any] | None = None,
                      base_model: str | None = None) -> str:
    """Markdown that says what was done, with the plan table and how to use the result.

    base_model: the source's Hub id, or None for a local folder (a path is not a valid
    `base_model` on the Hub; the card text names the folder instead).
    """
    d = plan.dims
    front = yaml.safe_dump(card_metadata(source_meta or {}, base_model), sort_keys=False, allow_unicode=True)
    return f"""---
{front}---
# {plan.source.rstrip('/').split('/')[-1]} with {plan.new_kv_heads} K/V heads (GQA)

Converted by uptrain {plan.record()['uptrain_version']} from `{plan.source}`
by {_METHODS[plan.method]}: {d.heads} query heads share {plan.new_kv_heads} K/V heads
(was {d.kv_heads}) in each of {d.layers} layers. {_UNCHANGED if plan.method != "fit" and plan.grouping == "contiguous" and not plan.refinement else _CHANGED}
KV cache per token: {cache_change(plan)}.{_refined(plan)}

```
{format_plan(plan)}
```

Grouped-query attention after Ainslie et al. 2023, "GQA: Training Generalized Multi-Query
Transformer Models from Multi-Head Checkpoints". A converted model loses some quality until it
is uptrained (continued pre-training, the paper uses 5% of the original steps): see
`python -m uptrain.train`. The machine-readable record is `uptrain_conversion.json`. The
licence and terms of the source model apply to this one.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")
```
"""
