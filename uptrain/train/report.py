"""What a finished run leaves behind: metrics log, loss-curve PNG, final model with its card."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from accelerate import Accelerator


class MetricsLog:
    """Append-only JSON-lines log of metric records (written by the main process only)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """Drop records later than `step` (a resumed run rewrites them); -1 drops all."""
        if not self.enabled or not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line] if self.path.exists() else []


def plot_losses(records: list[dict], png: Path) -> None:
    """Training LM loss per step and validation loss at its evaluation steps, to `png`.

    The LM part is drawn (not the KD+LM mix of a distillation run) so runs compare; the KD
    term, when there is one, gets its own line.
    """
    train = [(r["step"], r.get("lm_loss", r["loss"])) for r in records if "loss" in r]
    kd = [(r["step"], r["kd_loss"]) for r in records if "kd_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    import matplotlib  # here only: a second of import that the run needs once, at the end

    matplotlib.use("Agg")  # no display on servers; must precede pyplot
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train LM loss", lw=1)
    if kd:
        ax.plot(*zip(*kd), ":", label="train KD loss (KL to teacher)", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def model_card_section(record: dict) -> str:
    """Markdown section describing the training run (`record`: flat key -> value)."""
    rows = "\n".join(f"| {key} | {value} |" for key, value in record.items())
    return f"\n\n## Uptraining record (uptrain)\n\n| | |\n|---|---|\n{rows}\n"


# Licence and notice files travel with the weights (their terms usually require it).
_LICENCE_PREFIXES = ("LICENSE", "LICENCE", "NOTICE", "COPYING", "USE_POLICY")


def files_to_carry(source_dir: Path) -> list[Path]:
    """Files of the trained-from folder that the final model folder keeps: licences, notices,
    and uptrain's own records (e.g. the converter's uptrain_conversion.json)."""
    if not source_dir.is_dir():
        return []
    return sorted(p for p in source_dir.iterdir() if p.is_file() and (
        p.name.upper().startswith(_LICENCE_PREFIXES) or (p.name.startswith("uptrain_") and p.suffix == ".json")))


def save_final_model(
    accelerator: Accelerator, model, tokenizer, out_dir: Path, source_dir: Path, record: dict
) -> None:
    """Save a from_pretrained-loadable folder (safetensors, config, tokenizer, README.md).

    Call on every process: `get_state_dict` gathers sharded weights (FSDP / ZeRO-3).
    The model card of `source_dir` is kept and extended with the training record; its licence
    files and uptrain records are copied along.
    """
    from uptrain.train.shard import full_state_dict, is_sharded

    state_dict = full_state_dict(model) if is_sharded(model) else accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        if out_dir.exists():
            shutil.rmtree(out_dir)
        accelerator.unwrap_model(model).save_pretrained(out_dir, state_dict=state_dict)
        tokenizer.save_pretrained(out_dir)
        source_card = source_dir / "README.md"
        card = source_card.read_text() if source_card.is_file() else f"# {source_dir.name}, uptrained\n\nContinued pre-training of `{source_dir}` with uptrain."
        (out_dir / "README.md").write_text(card.rstrip() + model_card_section(record))
        for carried in files_to_carry(source_dir):
            shutil.copy2(carried, out_dir / carried.name)
    accelerator.wait_for_everyone()
