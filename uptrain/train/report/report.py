"""What a finished run leaves behind: the loss-curve PNG, the final model with its card (the
metrics log it reads is the run folder's: uptrain/train/state/run_state.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator

from uptrain.convert.io.output_dir import atomic_output_dir
from uptrain.convert.io.source import auxiliary_files


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


# Tokenizer files: the ones a separate `tokenizer` folder contributes to the final folder.
_TOKENIZER_NAMES = ("special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                    "chat_template.jinja", "chat_template.json")


def _is_tokenizer_file(path: Path) -> bool:
    return path.name.startswith("tokenizer") or path.name in _TOKENIZER_NAMES or path.suffix in (".model", ".tiktoken")


def files_to_carry(source_dir: Path, tokenizer_dir: Path | None = None) -> list[Path]:
    """Files of the trained-from folder that the final model folder keeps byte for byte, as the
    converter keeps them (`auxiliary_files`): tokenizer files, generation config, licences and
    notices, uptrain's own records (e.g. uptrain_conversion.json). With a separate tokenizer
    folder, its tokenizer files replace the source's."""
    carried = auxiliary_files(source_dir) if source_dir.is_dir() else []
    if tokenizer_dir is not None and tokenizer_dir.resolve() != source_dir.resolve():
        carried = [p for p in carried if not _is_tokenizer_file(p)]
        carried += [p for p in auxiliary_files(tokenizer_dir) if _is_tokenizer_file(p)]
    return sorted(carried, key=lambda p: p.name)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_final_model(accelerator: Accelerator, model, out_dir: Path, source_dir: Path, record: dict, *,
                     dtype: torch.dtype = torch.float32, tokenizer_dir: Path | None = None,
                     source_name: str | None = None) -> None:
    """Save a from_pretrained-loadable folder (safetensors in `dtype`, config, tokenizer, README.md).

    Call on every process: `get_state_dict` gathers sharded weights (FSDP / ZeRO-3).
    Written as the converter writes its output: all or nothing (`atomic_output_dir`), files
    readable as the umask allows (transformers writes model.safetensors 0600), the source's
    tokenizer files, generation config, licences and uptrain records copied byte for byte (not
    re-saved: tokenizer.save_pretrained adds loader flags of this machine such as "is_local").
    The model card of `source_dir` is kept and extended with the training record.
    """
    from uptrain.train.parallel.shard import full_state_dict, is_sharded

    state_dict = full_state_dict(model) if is_sharded(model) else accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
        unwrapped = accelerator.unwrap_model(model)
        with atomic_output_dir(out_dir) as tmp:
            unwrapped.save_pretrained(tmp, state_dict=state_dict)
            # save_pretrained records the dtype of the (float32) master weights: record the saved one.
            trained_dtype, unwrapped.config.dtype = unwrapped.config.dtype, str(dtype).removeprefix("torch.")
            unwrapped.config.save_pretrained(tmp)
            unwrapped.config.dtype = trained_dtype
            for carried in files_to_carry(source_dir, tokenizer_dir):
                shutil.copyfile(carried, tmp / carried.name)
            name = source_name or source_dir.name
            source_card = source_dir / "README.md"
            card = (source_card.read_text() if source_card.is_file()
                    else f"# {name}, uptrained\n\nContinued pre-training of `{name}` with uptrain.")
            (tmp / "README.md").write_text(card.rstrip() + model_card_section(record))
            mode = 0o666 & ~_umask()
            for file in tmp.iterdir():
                file.chmod(mode)
    accelerator.wait_for_everyone()
