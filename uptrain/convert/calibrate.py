"""Calibration for `--method fit` / `--grouping similar` (`--calib FILE --calib-tokens N`).

Runs the ORIGINAL model over N tokens of real text and records, for every layer, the second moment
E[x̃ x̃ᵀ] of the attention input x (what q/k/v projections see, after the input norm), augmented
with a constant 1 so that biases are fitted too: x̃ = [x; 1].

This loads the whole model in memory (in float32, on `--device`); streaming it layer by layer is
not implemented. Text is read by the trainer's and eval's reader (`uptrain.data.read_documents`),
so a file means the same documents everywhere: a .txt file is cut by `text_unit` (default
`paragraph`: documents separated by a blank line; `line`; `file`), .jsonl/.json/.parquet give
each record's "text" field.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from uptrain.data import DataSource, read_documents
from uptrain.errors import UsageError

WINDOW = 2048  # longest forward pass (tokens); documents longer than the model's context are cut in pieces


def read_calibration_texts(path: Path, text_unit: str = DataSource.text_unit) -> list[str]:
    """The documents of a calibration file, read as the trainer and eval read it (`text_unit` for .txt).

    UsageError (naming --calib) if it is missing, unreadable or holds no text.
    """
    if not path.exists():
        raise UsageError(f"--calib file {path} does not exist; pass a text file (.txt, .jsonl, .json or .parquet)")
    try:
        return read_documents(DataSource(files=[str(path)], text_unit=text_unit))
    except UsageError as err:
        raise UsageError(f"--calib: {err}") from None


@dataclass
class Calibration:
    """Attention-input moments of a model, computed once, on first use."""

    path: Path
    tokens: int
    device: str = "cpu"
    text_unit: str = DataSource.text_unit  # what one document of a .txt file is (as the trainer's data.*.text_unit)
    record: dict[str, Any] = field(default_factory=dict)  # what the conversion record says about it
    _moments: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    _model_dir: Path | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.tokens <= 0:
            raise UsageError(f"--calib-tokens must be positive, got {self.tokens}")
        self.path = Path(self.path)
        read_calibration_texts(self.path, self.text_unit)  # fail now, before any work
        self.record.update(file=str(self.path), text_unit=self.text_unit, tokens_requested=self.tokens,
                           device=self.device)

    def bind(self, model_dir: Path) -> "Calibration":
        if self._model_dir is not None and self._model_dir != model_dir:
            raise ValueError("a Calibration belongs to one model")
        self._model_dir = model_dir
        return self

    def sigma(self, layer: str) -> torch.Tensor:
        """E[x̃ x̃ᵀ] of the attention input of `layer` (a tensor-name prefix like 'model.layers.0.self_attn.')."""
        if self._moments is None:
            self._moments = self._run()
        try:
            return self._moments[layer]
        except KeyError:
            raise UsageError(f"calibration found no attention module {layer.rstrip('.')} in the loaded model") from None

    @torch.no_grad()
    def _run(self) -> dict[str, torch.Tensor]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        start = time.perf_counter()
        try:
            torch.empty(0, device=self.device)
        except (RuntimeError, AssertionError) as err:
            raise UsageError(f"--device {self.device!r} is not usable here: {str(err).splitlines()[0]}") from None
        model = AutoModelForCausalLM.from_pretrained(self._model_dir, dtype=torch.float32).to(self.device).eval()
        tokenizer = AutoTokenizer.from_pretrained(self._model_dir)
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}

        def hook(prefix: str):
            def pre(_module, args):
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype, device=x.device)], dim=1)
                sums[prefix] = sums.get(prefix, 0) + (x.T @ x).cpu()
                counts[prefix] = counts.get(prefix, 0) + len(x)
            return pre
        handles = [module.register_forward_pre_hook(hook(name[: -len(leaf)]))
                   for name, module in model.named_modules()
                   for leaf in ("q_proj", "qkv_proj") if name.endswith("." + leaf)]
        if not handles:
            raise UsageError("calibration found no q_proj/qkv_proj modules in the model")
        window = min(WINDOW, getattr(model.config.get_text_config(), "max_position_embeddings", None) or WINDOW)
        used = docs = 0
        try:
            for text in read_calibration_texts(self.path, self.text_unit):
                ids = tokenizer(text)["input_ids"][: self.tokens - used]
                for begin in range(0, len(ids), window):
                    model(input_ids=torch.tensor([ids[begin:begin + window]], device=self.device), use_cache=False)
                used += len(ids)
                docs += 1
                if used >= self.tokens:
                    break
        finally:
            for h in handles:
                h.remove()
        del model
        self.record.update(tokens_used=used, documents=docs, seconds=round(time.perf_counter() - start, 2))
        return {k: s / counts[k] for k, s in sums.items()}
