"""The architecture registry: where each model family keeps its K/V heads, as data.

A `Family` says which checkpoint tensors carry K/V heads (`KVTensor` rules, regexes on
tensor names), which config field holds the K/V head count, and what is special about it.
The converter has one code path for all of them; adding a family is a few lines here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from uptrain.errors import UsageError
from uptrain.convert.choices import QKVLayout

# How a rule's tensor holds heads:
#   "heads":     first dim is kv_heads equal blocks (k_proj/v_proj weight or bias, per-head norm)
#   "qkv":       a fused q/k/v projection in `Family.qkv_layout` (source -> target layout)
#   "head_list": one module per K/V head, the head index is the regex's first group
TensorKind = Literal["heads", "qkv", "head_list"]


@dataclass(frozen=True)
class KVTensor:
    """A checkpoint tensor that carries K/V heads: `pattern` is searched in the tensor name."""

    pattern: str
    kind: TensorKind = "heads"
    is_norm: bool = False  # a norm weight/bias: pooled with mean/first, never randomly initialised

    def match(self, name: str) -> re.Match[str] | None:
        return re.search(self.pattern, name)


@dataclass(frozen=True)
class Family:
    """One architecture family: the model types it covers and where their K/V heads live."""

    model_types: tuple[str, ...]
    tensors: tuple[KVTensor, ...]
    examples: str = ""
    notes: str = ""
    kv_field: str | None = "num_key_value_heads"  # None: the class has no such field (MHA unless MQA)
    when: tuple[tuple[str, Any], ...] = ()  # config values this entry requires (first match wins)
    qkv_layout: tuple[QKVLayout, QKVLayout] | None = None  # fused source -> target layout
    mqa_only: bool = False  # the class expresses only MHA or MQA: --kv-heads 1 is the only target
    target_config: tuple[tuple[str, Any], ...] = ()  # extra config.json changes the target needs
    approximate: str = ""  # why the conversion is not exact even on duplicated heads, if so
    cache_shrinks: bool = True  # False where transformers' cache keeps all heads anyway
    refuse: str = ""  # a matching config cannot be converted, for this reason


_KV_PROJ = KVTensor(r"(?:^|\.)(?:self_attn|attention)\.[kv]_proj\.(?:weight|bias)$")

FAMILIES: tuple[Family, ...] = (
    Family(("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
            "gemma2", "gemma3_text", "granite", "granitemoe", "starcoder2", "olmo", "nemotron",
            "helium", "glm", "glm4", "smollm3", "ernie4_5", "exaone4", "seed_oss", "exaone", "internlm3",
            "ministral", "arcee", "cohere2"),
           (_KV_PROJ,),
           examples="Llama-2-7B/13B, Vicuna, OpenLLaMA, Qwen1.5, Mistral, Mixtral, Gemma, OLMo-1B/7B, "
                    "StarCoder2, Granite, GLM-4",
           notes="separate q/k/v/o; k/v biases (Qwen1.5, StarCoder2, GLM) pooled like the weights; "
                 "shared per-head-dim q/k norms (Qwen3, Gemma3) need no pooling"),
    Family(("phi",), (_KV_PROJ,), examples="microsoft/phi-1_5, microsoft/phi-2",
           notes="biases on q/k/v/dense; output named `dense`; partial rotary"),
    Family(("phi3",), (KVTensor(r"\.self_attn\.qkv_proj\.(?:weight|bias)$", "qkv"),),
           qkv_layout=("blocks", "blocks"), examples="microsoft/Phi-3-mini-4k-instruct (MHA)",
           notes="fused qkv_proj: rows are the q, k, v blocks in turn"),
    Family(("stablelm",),
           (_KV_PROJ, KVTensor(r"\.self_attn\.k_layernorm\.norms\.(\d+)\.(?:weight|bias)$", "head_list",
                               is_norm=True)),
           examples="stabilityai/stablelm-2-1_6b, stablelm-3b-4e1t",
           notes="qk_layernorm: one key LayerNorm per K/V head, pooled; partial rotary"),
    Family(("cohere",), (_KV_PROJ, KVTensor(r"\.self_attn\.k_norm\.weight$", is_norm=True)),
           examples="CohereForAI/c4ai-command-r-v01",
           notes="use_qk_norm: per-head key norm [kv_heads, head_dim], pooled; interleaved RoPE"),
    Family(("olmo2", "olmo3"), (_KV_PROJ, KVTensor(r"\.self_attn\.k_norm\.weight$", is_norm=True)),
           examples="allenai/OLMo-2-0425-1B",
           approximate="k_norm is one RMSNorm over the whole K projection: its weight is pooled, "
                       "but the RMS statistic is then taken over fewer, averaged heads, so the result "
                       "is exact only when the heads of each group are identical"),
    Family(("falcon",), (KVTensor(r"\.self_attention\.query_key_value\.(?:weight|bias)$", "qkv"),),
           kv_field="num_kv_heads", when=(("new_decoder_architecture", True),),
           qkv_layout=("grouped", "grouped"), cache_shrinks=False,
           examples="tiiuae/falcon-40b, falcon-180B",
           notes="fused query_key_value grouped per K/V head; transformers' Falcon cache stores K/V "
                 "expanded to all heads, so the cache does not shrink there"),
    Family(("falcon",), (KVTensor(r"\.self_attention\.query_key_value\.(?:weight|bias)$", "qkv"),),
           kv_field=None, when=(("multi_query", False),), qkv_layout=("grouped", "blocks"),
           mqa_only=True, target_config=(("multi_query", True),),
           examples="tiiuae/falcon-rw-1b",
           notes="legacy Falcon: only multi-query (kv-heads 1) can be expressed"),
    Family(("falcon",), (), when=(("multi_query", True),),
           refuse="this Falcon checkpoint is already multi-query (one K/V head); nothing to pool"),
    Family(("gpt_bigcode",), (KVTensor(r"\.attn\.c_attn\.(?:weight|bias)$", "qkv"),),
           kv_field=None, when=(("multi_query", False),), qkv_layout=("grouped", "blocks"),
           mqa_only=True, target_config=(("multi_query", True),),
           examples="bigcode/gpt_bigcode-santacoder (MHA variants)",
           notes="`multi_query` is a bool: only kv-heads 1 is possible"),
    Family(("gpt_bigcode",), (), when=(("multi_query", True),),
           refuse="this GPTBigCode checkpoint is already multi-query (one K/V head); nothing to pool"),
)

_NO_KV_SETTING = ("its transformers class has no setting for fewer K/V heads than query heads, so a "
                  "GQA checkpoint of it could not be loaded; converting it needs another target class "
                  "(e.g. re-map the weights into a Llama-style model first)")
UNSUPPORTED: dict[str, str] = {
    **{t: _NO_KV_SETTING for t in ("gpt2", "gpt_neox", "opt", "bloom", "gptj", "codegen", "mpt",
                                   "gpt_neo", "persimmon", "xglm")},
    **{t: "it uses multi-head latent attention (compressed K/V), not K/V heads to pool; MLA models "
          "already have a small cache" for t in ("deepseek_v2", "deepseek_v3", "minicpm3")},
}


def supported_model_types() -> list[str]:
    """Every model type some registry entry converts, sorted."""
    return sorted({t for f in FAMILIES if not f.refuse for t in f.model_types})


def _config_matches(family: Family, config: dict[str, Any]) -> bool:
    return all(bool(config.get(key)) == bool(value) for key, value in family.when)


def family_for(config: dict[str, Any]) -> Family:
    """The registry entry for a raw config.json dict; UsageError for types we cannot convert."""
    model_type = config.get("model_type")
    if not model_type:
        raise UsageError("config.json has no model_type; is this a transformers checkpoint?")
    if model_type in UNSUPPORTED:
        raise UsageError(f"model type {model_type!r} cannot be converted to GQA: {UNSUPPORTED[model_type]}")
    for family in FAMILIES:
        if model_type in family.model_types and _config_matches(family, config):
            if family.refuse:
                raise UsageError(f"model type {model_type!r}: {family.refuse}")
            return family
    raise UsageError(
        f"model type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
    )


def markdown_table() -> str:
    """The README's table of supported model types, generated from the registry."""
    rows = ["| model type(s) | example public checkpoints | notes |", "|---|---|---|"]
    for family in FAMILIES:
        if family.refuse:
            continue
        when = ", ".join(f"{k}={v}" for k, v in family.when)
        notes = "; ".join(x for x in (f"when {when}" if when else "", family.notes,
                                      "kv-heads 1 only" if family.mqa_only and "only" not in family.notes else "",
                                      f"approximate: {family.approximate}" if family.approximate else "") if x)
        rows.append(f"| {', '.join(f'`{t}`' for t in family.model_types)} | {family.examples} | {notes} |")
    refused = ", ".join(f"`{t}`" for t in UNSUPPORTED)
    rows.append(f"| not convertible: {refused} | GPT-2, Pythia, OPT, BLOOM, GPT-J, MPT, DeepSeek-V2/V3 | "
                "the error says why: no K/V-head setting in transformers, or latent attention |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """`python -m uptrain.convert.architectures`: print the README's table of supported types."""
    import argparse

    argparse.ArgumentParser(prog="python -m uptrain.convert.architectures",
                            description="Print the markdown table of supported model types (from the "
                                        "registry), as README.md shows it.").parse_args(argv)
    print(markdown_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
