"""The copy probe: how well a model retrieves a passage it has already seen in its context.

Merging K/V heads puts the heads that copy from the context (induction and retrieval heads) at
risk, and next-token loss on short text hides it. The probe builds, from the scored text itself,
sequences `BOS + passage + filler + passage`: a passage of P tokens, then the d tokens that follow
it in the text (d = 0: repeated at once), then the passage again. It scores the passage's tokens 2..P
(the first cannot be copied) at their first occurrence and at their second, in the same forward
pass:

- `copy_first_loss`: mean loss at the first occurrence (nats/token; almost no context before it);
- `copy_second_loss`: at the second, where the model can copy; `copy_gain` = first - second;
- `copy_top1`: share of second-occurrence tokens whose argmax is the token (a model that copies
  perfectly: 1.0); `copy_first_top1` the same at the first;
- per distance d, the same (`copy_by_distance`). Against a source (`--reference`), a converted
  model's `copy_gain_kept` = its gain / the source's (1.0: all of it kept).

Distances: 0, half-way and the farthest that fits the window (`default_distances`), so the farthest
second occurrence ends at the window's last position: at a 7B model's context this is the cheap
needle-in-a-haystack. Passages are `passages` evenly spaced starts in the text's tokens (documents
joined), the same for every model that shares a tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from uptrain.measure.fidelity import _cache_argument
from uptrain.measure.kv_cache import KVFormat, new_cache

PASSAGE = 64  # tokens of a passage (fewer in a window under 8 x 64)
PASSAGES = 16  # passages per distance
WARN_TOP1_DROP = 0.05  # a converted model's copy top-1 this far below its source's is warned about


@dataclass(frozen=True)
class CopyItem:
    """One probe sequence: `ids` LongTensor [L] = BOS? + passage + filler + passage."""

    ids: torch.Tensor
    passage: int  # P
    distance: int  # d
    first: int  # index in `ids` of the passage's first token (1 after a BOS, else 0)

    def positions(self, second: bool) -> torch.Tensor:
        """Indices of the scored tokens (the passage's tokens 2..P) of one occurrence: LongTensor [P - 1]."""
        start = self.first + (self.passage + self.distance if second else 0)
        return torch.arange(start + 1, start + self.passage)


def default_distances(window: int, passage: int, with_bos: bool) -> list[int]:
    """0, half-way and the farthest distance d whose sequence (BOS? + 2P + d) fits `window` tokens."""
    farthest = window - 2 * passage - int(with_bos)
    if farthest < 0:
        return []
    return sorted({0, farthest // 2, farthest})


def passage_length(window: int) -> int:
    """PASSAGE, or window // 8 (at least 2) in a smaller window."""
    return max(2, min(PASSAGE, window // 8))


def copy_items(stream: torch.Tensor, passage: int, distances: Sequence[int], passages: int,
               bos: int | None) -> list[CopyItem]:
    """The probe sequences from `stream` (LongTensor [N], the text's tokens without BOS): per distance
    d, `passages` starts spaced evenly over the stream (the same starts for every d that fits), each
    passage followed by the d tokens after it, then repeated. A distance the stream is too short for
    is left out."""
    items = []
    head = [] if bos is None else [bos]
    for d in distances:
        need = passage + d
        if len(stream) < need or passages < 1:
            continue
        room = len(stream) - need
        starts = sorted({room * i // max(1, passages - 1) if passages > 1 else 0 for i in range(passages)})
        for a in starts:
            text = stream[a:a + need].tolist()
            items.append(CopyItem(torch.tensor(head + text + text[:passage]), passage, d, len(head)))
    return items


@torch.no_grad()
def item_scores(model: torch.nn.Module, item: CopyItem, kv: KVFormat | None = None) -> dict[str, torch.Tensor]:
    """Per scored token of each occurrence: loss [P - 1] and top-1 hit [P - 1] (float)."""
    ids = item.ids.to(next(model.parameters()).device).unsqueeze(0)  # [1, L]
    cache = new_cache(kv, model.config)
    with_cache = {"use_cache": False} if cache is None else {"use_cache": True, _cache_argument(model): cache}
    logits = model(input_ids=ids, **with_cache).logits[0].float()  # [L, vocab]
    out = {}
    for name, second in (("first", False), ("second", True)):
        at = item.positions(second).to(ids.device)
        pred, target = logits[at - 1], ids[0, at]
        out[f"{name}_loss"] = torch.nn.functional.cross_entropy(pred, target, reduction="none").cpu()
        out[f"{name}_hit"] = (pred.argmax(-1) == target).float().cpu()
    return out


def copy_probe(model: torch.nn.Module, items: Sequence[CopyItem], kv: KVFormat | None = None) -> dict | None:
    """The probe's fields (module doc) over `items`; None for no items."""
    if not items:
        return None
    by_distance: dict[int, list[dict]] = {}
    for item in items:
        by_distance.setdefault(item.distance, []).append(item_scores(model, item, kv))

    def means(scores: list[dict]) -> dict:
        cat = {k: torch.cat([s[k] for s in scores]) for k in scores[0]}
        return {"first_loss": cat["first_loss"].mean().item(), "second_loss": cat["second_loss"].mean().item(),
                "top1": cat["second_hit"].mean().item(), "first_top1": cat["first_hit"].mean().item()}

    every = means([s for scores in by_distance.values() for s in scores])
    return {"copy_first_loss": every["first_loss"], "copy_second_loss": every["second_loss"],
            "copy_gain": every["first_loss"] - every["second_loss"], "copy_top1": every["top1"],
            "copy_first_top1": every["first_top1"], "copy_passage": items[0].passage,
            "copy_passages": len(by_distance[next(iter(by_distance))]), "copy_distances": sorted(by_distance),
            "copy_by_distance": {str(d): means(s) for d, s in sorted(by_distance.items())}}


def text_stream(token_sequences: Sequence[torch.Tensor], bos: int | None) -> torch.Tensor:
    """The scored documents' tokens joined (each document's leading BOS dropped): LongTensor [N]."""
    parts = [t[1:] if bos is not None and len(t) and int(t[0]) == bos else t for t in token_sequences]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def probe_model(model: torch.nn.Module, token_sequences: Sequence[torch.Tensor], window: int,
                passages: int = PASSAGES, kv: KVFormat | None = None) -> dict | None:
    """`copy_probe` of `model` on its tokenized scoring text within `window` tokens (module doc)."""
    bos = getattr(model.config, "bos_token_id", None)
    bos = bos[0] if isinstance(bos, list) else bos
    p = passage_length(window)
    items = copy_items(text_stream(token_sequences, bos), p, default_distances(window, p, bos is not None),
                       passages, bos)
    return copy_probe(model, items, kv)


def copy_against(result: dict, source: dict) -> dict:
    """A model's probe beside its source's: the share of the source's copy gain it keeps."""
    gain = source["copy_gain"]
    return {"copy_gain_kept": result["copy_gain"] / gain if gain > 0 else None,
            "source_copy_top1": source["copy_top1"], "source_copy_gain": gain}


def copy_warning(model: str, result: dict) -> str | None:
    """The warning when a model's copy top-1 is more than WARN_TOP1_DROP below its source's."""
    source = result.get("source_copy_top1")
    if source is None or result.get("copy_top1") is None or source - result["copy_top1"] <= WARN_TOP1_DROP:
        return None
    return (f"{model}: copy top-1 {result['copy_top1']:.1%} against the source's {source:.1%} (more than "
            f"{WARN_TOP1_DROP * 100:.0f} points below): it retrieves less from its context than its source; see docs/measure.md "
            "(the copy probe)")


COPY_COLUMNS = ["copy loss (2nd)", "copy top-1", "copy gain kept"]  # the demo's and compare's columns


def copy_cells(r) -> list[str]:
    """COPY_COLUMNS' cells of an EvalResult (dashes where the probe did not run)."""
    if r.copy_gain is None:
        return ["—"] * len(COPY_COLUMNS)
    kept = "—" if r.copy_gain_kept is None else f"{r.copy_gain_kept:.0%}"
    return [f"{r.copy_second_loss:.3f}", f"{r.copy_top1:.1%}", kept]
