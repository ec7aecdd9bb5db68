"""The whole model of the chosen starts, checked against mean pooling's (issue 50).

Behind a key norm, `--method fit --calib` (without `--refine`) takes per layer the fit's start or
mean pooling's, whichever has the lower attention-output error on the calibration text
(`LayerRefiner.choose`). Layer errors do not add up to the model's: on a trained Qwen3-style model
(examples/qwen3-keynorm-trained) the model of the chosen layers was further from the source than
mean pooling's on every layer (KL 1.14 against 1.09 nats/token on the calibration text), although
each chosen layer was at least as close as mean pooling's. Only the whole model can tell.

So `WholeModelCheck` runs both converted models beside the calibration stream, on its first
sequences (up to `SCORED_TOKENS` tokens): each layer the source's own (MLP, norms) with the converted
attention in its place (`Layer.run_with`), starting from the source's embeddings. After the last
layer both go through the source's head (`LayerStream.kl_to_source`), and where the chosen starts'
model is the further from the source, the conversion writes mean pooling's start on every layer
instead (`layer_outputs.mean_outputs`, written over the chosen tensors while the output is still a
temporary folder: `pipeline.build_outputs`). The written model is then never further from the
source than mean pooling's, on the text checked.

Cost: two more forward passes of each layer over at most SCORED_TOKENS tokens, and each layer's
whole module held while it is converted (the stream keeps 'all').
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from uptrain.convert.layers.layer_stream import SCORED_TOKENS, StreamUnsupported
from uptrain.convert.layers.refine_layer import student_attention
from uptrain.convert.registry.architectures import Family

MODELS = ("chosen", "mean")  # the two models run: the starts as chosen per layer, and mean pooling's


def first_sequences(lengths: list[int], tokens: int = SCORED_TOKENS) -> int:
    """How many of the first sequences (of `lengths` tokens) the check runs: sequences in order
    until `tokens` tokens are taken (at least one)."""
    taken = count = 0
    for length in lengths:
        if count and taken >= tokens:
            break
        taken += length
        count += 1
    return count


@dataclass
class WholeModelCheck:
    """The two converted models run layer by layer beside the calibration stream (`Layerwise.checker`)."""

    calibration: Any  # the bound `calibrate.Calibration` (its user keeps 'all')
    config: Any  # the converted model's (text) config
    family: Family
    layers: int  # decoder layers: the verdict comes after the last
    user: int = 0
    # name in MODELS -> that model's hidden states entering the next layer, per sequence [T, D]
    _tracks: dict[str, list[Tensor]] | None = field(default=None, repr=False)
    done: int = 0  # layers run so far
    verdict: dict[str, Any] | None = None  # after the last layer: the KLs and which model is written

    def advance(self, layer: str, starts: dict[str, dict[str, Tensor]]) -> dict[str, Any] | None:
        """Run attention `layer`'s decoder layer for each model, with its start (`starts`: name in
        MODELS -> role.param -> tensor) as the attention; after the last layer, the verdict."""
        original = self.calibration.layer(layer, self.user)
        if self._tracks is None:
            first = self.calibration.first_inputs(first_sequences([len(s) for s in self.calibration.windows()[0]]))
            self._tracks = {name: [x.clone() for x in first] for name in MODELS}
        for name in MODELS:
            attention = student_attention(original, self.config, self.family, starts[name], original.device)
            original.run_with(attention, self._tracks[name])
        self.done += 1
        if self.done == self.layers:
            self.verdict = self._judge()
        return self.verdict

    def _judge(self) -> dict[str, Any]:
        """Both models' KL to the source; mean pooling's written where it is the lower."""
        tracks, self._tracks = self._tracks, None
        try:
            kl, tokens = self.calibration.kl_to_source(tracks, self.user)
        except (StreamUnsupported, RuntimeError) as err:
            return {"written": "chosen", "not_measured": " ".join(str(err).split())[:200] or type(err).__name__}
        written = "mean" if kl["mean"] < kl["chosen"] else "chosen"
        return {"kl_chosen": round(kl["chosen"], 6), "kl_mean": round(kl["mean"], 6), "tokens": tokens,
                "written": written}


def verdict_note(verdict: dict[str, Any]) -> str:
    """The plan's note on the whole-model check (`WholeModelCheck.verdict`)."""
    if "not_measured" in verdict:
        return f"the whole model of the chosen starts was not checked against mean pooling's: {verdict['not_measured']}"
    kls = (f"KL to the source on {verdict['tokens']:,} calibration tokens: chosen starts {verdict['kl_chosen']:.4f}, "
           f"mean pooling {verdict['kl_mean']:.4f} nats/token")
    if verdict["written"] == "mean":
        return (f"whole-model check: the model of the per-layer chosen starts is further from the source than mean "
                f"pooling's ({kls}): mean pooling's start is written on every layer")
    return f"whole-model check: the chosen starts are kept ({kls})"
