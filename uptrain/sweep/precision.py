"""The sweep's second axis: every point scored again with its K/V cache stored in each `--kv-cache` format.

A runtime quantizes the cache for free (vLLM `--kv-cache-dtype fp8`, llama.cpp `-ctk q8_0`), so the
trade a user chooses from is K/V heads x cache precision. For every model of the sweep (the source
and each count) and every format asked, a point labelled "<label> <format>" (e.g. "fit kv2 fp8"),
scored with `uptrain.eval`'s code and `uptrain.measure.kv_cache`'s emulation; its KV bytes per token
are the format's, block scales counted. A format the model cannot take (a llama.cpp block that does
not divide head_dim) is left out with the reason, as llama.cpp refuses it.

Kept for reuse by content: a precision point records the fingerprint of the model folder it scored
(`model_sha256`) and its scoring settings; a rerun keeps it only when both are the same. After
`--uptrain-tokens`, each precision point scores its count's uptrained model in its format, keyed
the same way by the uptrained folder's fingerprint.

The frontier sweep.png draws is `uptrain.measure.plots.frontier`. The recommendation over pairs (`recommend_pair`): the point of fewest KV bytes per token within the
bound (loss, and KL where given; KL alone where the loss cannot choose), of the chosen method or of
the source with a quantized cache and no conversion, which it says when one already meets the bound.
"""

from __future__ import annotations

from pathlib import Path

from uptrain.measure.kv_cache import FORMATS, KVFormat, kv_formats, why_not


def cache_formats(spec: str | None, head_dim: int) -> tuple[list[KVFormat], dict[str, str]]:
    """(the formats to score besides the model's own dtype, {name: why left out}) for `--kv-cache`."""
    if spec is None:
        return [], {}
    asked = [f for f in kv_formats(spec) if f.round_trip is not None]  # `model` is always scored
    refused = {f.name: why for f in asked if (why := why_not(f, head_dim))}
    return [f for f in asked if f.name not in refused], refused


def precision_points(base, formats: list[KVFormat], scoring: dict, done: dict, score, fingerprint) -> list:
    """The points of `base` (a point at the model's dtype) in every format, each kept from `done` (the
    earlier run's points by label) when it scored the same folder content the same way, else scored by
    `score(folder, label, method, kv_heads, settings, seconds, kv_cache=name)`."""
    made = []
    content = fingerprint(Path(base.folder))
    for fmt in formats:
        label = f"{base.label} {fmt.name}"
        wanted = {**scoring, "kv_cache": fmt.name}
        old = done.get(label)
        if old is not None and old.settings.get("scoring") == wanted and old.settings.get("model_sha256") == content:
            print(f"== {label}: kept from the earlier run", flush=True)
            made.append(old)
            continue
        settings = {k: v for k, v in base.settings.items() if k not in ("scoring", "model_sha256")}
        point = score(Path(base.folder), label, base.method, base.kv_heads, settings, 0.0, kv_cache=fmt.name)
        point.settings.update(scoring=wanted, model_sha256=content)
        print(f"== {label}: loss {point.loss:.4f} with a {fmt.name} cache, {point.kv_bytes_per_token:,.4g} B/token",
              flush=True)
        made.append(point)
    return made


def score_after_uptraining(points: list, texts: list[str], max_length: int, stride: int, source: Path,
                           fingerprint, write) -> None:
    """Each precision point whose count was uptrained: the uptrained model scored in its format (kept
    when the uptrained folder's content and the settings are those it scored); `write()` after each."""
    from uptrain.measure.eval import evaluate_paths
    from uptrain.measure.fidelity import GreedySettings
    from uptrain.sweep.extras import fidelity_of

    bases = {p.label: p for p in points if p.kv_cache == "model"}
    for p in points:
        base = bases.get(p.label.rsplit(" ", 1)[0]) if p.kv_cache != "model" else None
        if base is None or base.uptrained_folder is None or base.loss_after_uptraining is None:
            continue
        wanted = {**(base.uptrain_settings or {}), "model_sha256": fingerprint(Path(base.uptrained_folder))}
        if p.loss_after_uptraining is not None and p.uptrain_settings == wanted:
            continue
        greedy = GreedySettings(**p.settings["scoring"]["fidelity"])
        (result,) = evaluate_paths([base.uptrained_folder], texts, max_length, stride, reference=str(source),
                                   greedy=greedy, kv_cache=p.kv_cache)
        p.loss_after_uptraining, p.perplexity_after_uptraining = result.loss, result.perplexity
        p.fidelity_after_uptraining = fidelity_of(result)
        p.uptrain_tokens, p.uptrain_steps = base.uptrain_tokens, base.uptrain_steps
        p.uptrained_folder, p.uptrain_settings = base.uptrained_folder, wanted
        print(f"   {p.label} after uptraining: loss {result.loss:.4f} with a {p.kv_cache} cache", flush=True)
        write()


def pair_name(p) -> str:
    """'4 K/V heads with an fp8 cache', 'the source (8 K/V heads) with a q8_0 cache', '... at the model's dtype'."""
    heads = f"the source ({p.kv_heads} K/V heads)" if p.method == "source" else f"{p.kv_heads} K/V heads"
    cache = "at the model's own dtype" if p.kv_cache == "model" else f"with a{'n' if p.kv_cache[0] in 'f' else ''} {p.kv_cache} cache"
    return f"{heads} {cache}"


def recommend_pair(candidates: list, source, max_increase: float, max_kl: float | None = None,
                   loss_misleads: bool = False) -> str:
    """The candidate (the chosen method's points and the source's quantized-cache points, every format)
    with the fewest KV bytes per token within the bound: loss within `max_increase` of the source's at
    its own dtype (and KL within `max_kl`); KL alone (bounded by `max_kl`, else max_increase x the
    source's loss in nats) where the loss cannot choose. Says when the source with a quantized cache and
    no conversion already meets the bound, and the deploy flag of the pick's format."""
    if loss_misleads:
        bound = max_kl if max_kl is not None else max_increase * source.loss
        fits = [p for p in candidates if p.kl_to_source is not None and p.kl_to_source <= bound]
        within = f"KL {bound:.4f} of the source (the loss cannot choose here: see the warnings)"
    else:
        limit = source.loss * (1 + max_increase)
        fits = [p for p in candidates if p.loss <= limit and (max_kl is None or (
            p.kl_to_source is not None and p.kl_to_source <= max_kl))]
        within = f"{max_increase:.1%} of the source's loss" + ("" if max_kl is None else f" and KL {max_kl:g}")
    if not fits:
        return (f"over K/V heads x cache: no pair is within {within}; keep more K/V heads or a wider cache, "
                f"or uptrain")
    pick = min(fits, key=lambda p: (p.kv_bytes_per_token, p.loss))
    line = (f"over K/V heads x cache: recommended {pair_name(pick)}: "
            f"{source.kv_bytes_per_token / pick.kv_bytes_per_token:.3g}x smaller KV cache "
            f"({pick.kv_bytes_per_token:,.4g} B/token against the source's {source.kv_bytes_per_token:,.4g}), "
            f"loss {pick.loss:.4f} ({pick.loss / source.loss - 1:+.2%})"
            + ("" if pick.kl_to_source is None else f", KL {pick.kl_to_source:.4f}")
            + f", the fewest KV bytes within {within}")
    if pick.kv_cache != "model":
        line += f"; deploy with {FORMATS[pick.kv_cache].deploy}"
    alone = [p for p in fits if p.method == "source" and p.kv_cache != "model"]
    if alone and pick.method != "source":
        best = min(alone, key=lambda p: (p.kv_bytes_per_token, p.loss))
        line += (f". A precision alone, with no conversion, already meets the bound: {pair_name(best)}, "
                 f"{source.kv_bytes_per_token / best.kv_bytes_per_token:.3g}x smaller, {best.loss / source.loss - 1:+.2%}")
    elif pick.method == "source":
        line += ". No conversion is needed for this bound: the cache's precision alone meets it"
    return line

