"""The architecture registry: everything the project knows about a model family, as data.

A `Family` says how its attention is named (`Attention`: the module in each decoder layer and its
q/k/v/o or fused projections), which checkpoint tensors carry K/V heads (derived from those names,
plus `KVTensor` rules for norms), which config field holds the K/V head count, how RoPE pairs
dimensions, where key norms sit, and what else is special about it. The converter, the
layer-at-a-time conversions (`layerwise.py`), calibration and the trainer's `trainable` read these
facts from here and nowhere else; adding a family is a few typed lines.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, NamedTuple

from uptrain.errors import UsageError
from uptrain.convert.registry.choices import QKVLayout

# How a rule's tensor holds heads:
#   "heads":     first dim is kv_heads equal blocks (k_proj/v_proj weight or bias, per-head norm)
#   "qkv":       a fused q/k/v projection in `Family.qkv_layout` (source -> target layout)
#   "head_list": one module per K/V head, the head index is the regex's first group
TensorKind = Literal["heads", "qkv", "head_list"]
# Where a family normalises keys after the k projection (nonlinear in the projected keys):
#   "shared":   one norm over head_dim, the same weights for every head (Qwen3, Gemma 3, Phi qk_layernorm)
#   "per_head": one norm per K/V head (StableLM qk_layernorm, Cohere use_qk_norm): pooled with the heads
#   "whole":    one norm over the whole K projection (OLMo-2/3): its weight is pooled
KeyNorm = Literal["shared", "per_head", "whole"]
Role = Literal["q", "k", "v", "o", "qkv"]


@dataclass(frozen=True)
class KVTensor:
    """A checkpoint tensor that carries K/V heads: `pattern` is searched in the tensor name."""

    pattern: str
    kind: TensorKind = "heads"
    is_norm: bool = False  # a norm weight/bias: pooled with mean/first, never randomly initialised

    def match(self, name: str) -> re.Match[str] | None:
        return re.search(self.pattern, name)


class Projection(NamedTuple):
    """A parameter or module name taken apart: `layer` is the attention prefix ("model.layers.0.self_attn.")."""

    layer: str
    role: Role
    param: str  # "weight" / "bias"; "" for a module name


@dataclass(frozen=True)
class Attention:
    """How a family names its attention: the module in each decoder layer and its projections.

    q/k/v None: fused into `qkv`. Names are module names (a parameter adds .weight / .bias).
    """

    module: str = "self_attn"
    q: str | None = "q_proj"
    k: str | None = "k_proj"
    v: str | None = "v_proj"
    o: str = "o_proj"
    qkv: str | None = None

    def roles(self) -> dict[str, Role]:
        """Projection module name -> its role."""
        pairs = (("q", self.q), ("k", self.k), ("v", self.v), ("o", self.o), ("qkv", self.qkv))
        return {name: role for role, name in pairs if name}  # type: ignore[misc]

    @property
    def input(self) -> str:
        """The projection whose input is the attention input (the normed hidden state)."""
        return self.qkv or self.q  # type: ignore[return-value]

    @property
    def kv(self) -> tuple[str, ...]:
        """The projections that hold K/V rows (k and v, or the fused qkv)."""
        return (self.qkv,) if self.qkv else (self.k, self.v)  # type: ignore[return-value]

    def match(self, name: str) -> Projection | None:
        """`name` (a parameter "….self_attn.q_proj.weight" or a module "….self_attn.q_proj") as a
        `Projection`; None when it is not one of this family's attention projections."""
        m = _projection_re(self).match(name)
        return Projection(m["layer"], self.roles()[m["proj"]], m["param"] or "") if m else None

    def input_modules(self, module_names: Iterable[str]) -> dict[str, str]:
        """Module name -> attention prefix, for the modules that see each layer's attention input
        (what calibration hooks: q_proj, or the fused projection)."""
        found = {}
        for name in module_names:
            p = self.match(name)
            if p is not None and not p.param and p.role in ("q", "qkv"):
                found[name] = p.layer
        return found

    def parameters_pattern(self) -> str:
        """Regex searched in parameter names: every parameter inside an attention module."""
        return rf"(?:^|\.){re.escape(self.module)}\."

    def projections_pattern(self) -> str:
        """Regex searched in parameter names: the q/k/v/o (or fused) projections' weights and biases."""
        names = "|".join(re.escape(n) for n in self.roles())
        return rf"(?:^|\.){re.escape(self.module)}\.(?:{names})\.(?:weight|bias)$"


@lru_cache(maxsize=None)
def _projection_re(attention: Attention) -> re.Pattern[str]:
    names = "|".join(re.escape(n) for n in attention.roles())
    return re.compile(rf"^(?P<layer>(?:.*\.)?{re.escape(attention.module)}\.)(?P<proj>{names})"
                      rf"(?:\.(?P<param>weight|bias))?$")


@lru_cache(maxsize=None)
def _kv_projections(attention: Attention) -> KVTensor:
    names = "|".join(re.escape(n) for n in attention.kv)
    return KVTensor(rf"(?:^|\.){re.escape(attention.module)}\.(?:{names})\.(?:weight|bias)$",
                    "qkv" if attention.qkv else "heads")


@dataclass(frozen=True)
class Family:
    """One architecture family: the model types it covers and what is known about their attention."""

    model_types: tuple[str, ...]
    attention: Attention = Attention()  # names of the checkpoint's tensors
    norms: tuple[KVTensor, ...] = ()  # per-head or whole-K norm tensors pooled with the K/V heads
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
    interleaved_rope: bool = False  # RoPE rotates dims (2i, 2i+1) together; else (i, i + head_dim/2)
    key_norm: KeyNorm | None = None  # a norm of the keys after the k projection, see `KeyNorm`
    key_norm_module: str = ""  # its module name inside the attention module ("k_norm")
    key_norm_flag: str | None = None  # the config field that switches the key norm on; None: always on
    key_norm_centred: bool = False  # the key norm is a LayerNorm (centres over its dims first), else an RMSNorm
    loaded: Attention | None = None  # the loaded model's module names, where transformers renames the checkpoint's

    @property
    def modules(self) -> Attention:
        """The attention names of the loaded transformers model (`attention` names checkpoint tensors)."""
        return self.loaded or self.attention

    @property
    def tensors(self) -> tuple[KVTensor, ...]:
        """The checkpoint tensors that carry K/V heads: the K/V (or fused) projections, then `norms`."""
        return (_kv_projections(self.attention), *self.norms)

    @property
    def kv_between_queries(self) -> bool:
        """The fused source layout puts each K/V head between its query heads (Falcon, GPTBigCode)."""
        return self.qkv_layout is not None and self.qkv_layout[0] == "grouped"

    def key_norm_in(self, config: dict[str, Any]) -> KeyNorm | None:
        """The key norm a model of this family with `config` (as transformers reads it) has, if any."""
        if self.key_norm is None or (self.key_norm_flag and not config.get(self.key_norm_flag)):
            return None
        return self.key_norm


_LLAMA_NOTES = "separate q/k/v/o; k/v biases ({}) pooled like the weights"
_FUSED_QKV = Attention("self_attention", None, None, None, "dense", "query_key_value")

FAMILIES: tuple[Family, ...] = (
    Family(("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "gemma", "gemma2", "granite", "granitemoe",
            "starcoder2", "olmo", "nemotron", "smollm3", "seed_oss", "internlm3", "ministral", "arcee"),
           examples="Llama-2-7B/13B, Vicuna, OpenLLaMA, Qwen1.5, Mistral, Mixtral, Gemma, OLMo-1B/7B, "
                    "StarCoder2, Granite",
           notes=_LLAMA_NOTES.format("Qwen1.5, StarCoder2")),
    Family(("exaone",), Attention("attention", o="out_proj"), loaded=Attention(),
           examples="LGAI-EXAONE/EXAONE-3.5-2.4B-Instruct",
           notes="checkpoints name attention `attn.attention` with `out_proj`; loaded as `self_attn`, `o_proj`"),
    Family(("helium", "glm", "glm4", "ernie4_5", "cohere2"), interleaved_rope=True,
           examples="GLM-4, Helium, ERNIE 4.5, Command R7B",
           notes=_LLAMA_NOTES.format("GLM, ERNIE 4.5") + "; interleaved RoPE"),
    Family(("qwen3", "qwen3_moe", "gemma3_text", "exaone4"), key_norm="shared", key_norm_module="k_norm",
           examples="Qwen3, Gemma 3, EXAONE 4",
           notes="separate q/k/v/o; shared per-head-dim q/k norms need no pooling"),
    Family(("phi",), Attention(o="dense"), key_norm="shared", key_norm_module="k_layernorm",
           key_norm_flag="qk_layernorm", key_norm_centred=True, examples="microsoft/phi-1_5, microsoft/phi-2",
           notes="biases on q/k/v/dense; output named `dense`; partial rotary"),
    Family(("phi3",), Attention(q=None, k=None, v=None, qkv="qkv_proj"),
           qkv_layout=("blocks", "blocks"), examples="microsoft/Phi-3-mini-4k-instruct (MHA)",
           notes="fused qkv_proj: rows are the q, k, v blocks in turn"),
    Family(("stablelm",),
           norms=(KVTensor(r"\.self_attn\.k_layernorm\.norms\.(\d+)\.(?:weight|bias)$", "head_list", is_norm=True),),
           key_norm="per_head", key_norm_module="k_layernorm", key_norm_flag="qk_layernorm", key_norm_centred=True,
           examples="stabilityai/stablelm-2-1_6b, stablelm-3b-4e1t",
           notes="qk_layernorm: one key LayerNorm per K/V head, pooled; partial rotary"),
    Family(("cohere",), norms=(KVTensor(r"\.self_attn\.k_norm\.weight$", is_norm=True),), interleaved_rope=True,
           key_norm="per_head", key_norm_module="k_norm", key_norm_flag="use_qk_norm", key_norm_centred=True,
           examples="CohereForAI/c4ai-command-r-v01",
           notes="use_qk_norm: per-head key norm [kv_heads, head_dim], pooled; interleaved RoPE"),
    Family(("olmo2", "olmo3"), norms=(KVTensor(r"\.self_attn\.k_norm\.weight$", is_norm=True),),
           key_norm="whole", key_norm_module="k_norm", examples="allenai/OLMo-2-0425-1B",
           approximate="k_norm is one RMSNorm over the whole K projection: its weight is pooled, "
                       "but the RMS statistic is then taken over fewer, averaged heads, so the result "
                       "is exact only when the heads of each group are identical"),
    Family(("falcon",), _FUSED_QKV,
           kv_field="num_kv_heads", when=(("new_decoder_architecture", True),),
           qkv_layout=("grouped", "grouped"), cache_shrinks=False,
           examples="tiiuae/falcon-40b, falcon-180B",
           notes="fused query_key_value grouped per K/V head; transformers' Falcon cache stores K/V "
                 "expanded to all heads, so the cache does not shrink there"),
    Family(("falcon",), _FUSED_QKV,
           kv_field=None, when=(("multi_query", False),), qkv_layout=("grouped", "blocks"),
           mqa_only=True, target_config=(("multi_query", True),),
           examples="tiiuae/falcon-rw-1b",
           notes="legacy Falcon: only multi-query (kv-heads 1) can be expressed"),
    Family(("falcon",), _FUSED_QKV, kv_field=None, when=(("multi_query", True),),
           refuse="this Falcon checkpoint is already multi-query (one K/V head); nothing to pool"),
    Family(("gpt_bigcode",), Attention("attn", None, None, None, "c_proj", "c_attn"),
           kv_field=None, when=(("multi_query", False),), qkv_layout=("grouped", "blocks"),
           mqa_only=True, target_config=(("multi_query", True),),
           examples="bigcode/gpt_bigcode-santacoder (MHA variants)",
           notes="`multi_query` is a bool: only kv-heads 1 is possible; no RoPE (learned positions)"),
    Family(("gpt_bigcode",), Attention("attn", None, None, None, "c_proj", "c_attn"), kv_field=None,
           when=(("multi_query", True),),
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


def attention_for(model_type: str) -> Attention | None:
    """How loaded transformers models of `model_type` name their attention modules (`Family.modules`),
    converted or not (an already multi-query Falcon is refused by `family_for` but trains and
    calibrates by the same names); None outside the registry."""
    return next((f.modules for f in FAMILIES if model_type in f.model_types), None)


def refine_support(family: Family) -> str:
    """What `--method fit` / `--refine` do for a family, as the README's table says it (the
    refusals themselves: `layerwise.check_layerwise`, `refine_layer.check_refine`; the fit's start
    per config: `layers/fit_start.py`)."""
    flag = f"; with {family.key_norm_flag}" if family.key_norm_flag else ":"
    if family.kv_between_queries:
        return "mean/first/random only; no --refine"
    if family.key_norm == "shared":
        return (f"fit{flag} keys merged behind the shared key norm (their direction; the norm keeps "
                f"the length), values fitted; --refine from fit")
    if family.key_norm in ("per_head", "whole"):
        kind = "per-head" if family.key_norm == "per_head" else "whole-K"
        return (f"fit{flag} keys merged behind the {kind} key norm, its pooled weight fitted to their "
                f"length, values fitted; --refine from fit, the pooled key norm trained too")
    return "fit (partial rotary or clip_qkv in the config: a start of its own); --refine from fit"


def markdown_table() -> str:
    """The README's table of supported model types, generated from the registry."""
    rows = ["| model type(s) | example public checkpoints | notes | fit / refine |", "|---|---|---|---|"]
    for family in FAMILIES:
        if family.refuse:
            continue
        when = ", ".join(f"{k}={v}" for k, v in family.when)
        notes = "; ".join(x for x in (f"when {when}" if when else "", family.notes,
                                      "kv-heads 1 only" if family.mqa_only and "only" not in family.notes else "",
                                      f"approximate: {family.approximate}" if family.approximate else "") if x)
        rows.append(f"| {', '.join(f'`{t}`' for t in family.model_types)} | {family.examples} | {notes} | "
                    f"{refine_support(family)} |")
    refused = ", ".join(f"`{t}`" for t in UNSUPPORTED)
    rows.append(f"| not convertible: {refused} | GPT-2, Pythia, OPT, BLOOM, GPT-J, MPT, DeepSeek-V2/V3 | "
                "the error says why: no K/V-head setting in transformers, or latent attention | — |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """`python -m uptrain.convert.registry.architectures`: print the README's table of supported types."""
    import argparse

    argparse.ArgumentParser(prog="python -m uptrain.convert.registry.architectures",
                            description="Print the markdown table of supported model types (from the "
                                        "registry), as README.md shows it.").parse_args(argv)
    print(markdown_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
