"""Prepare the small-scale GQA-paper reproduction: data split, tokenizer, reference MHA model.

    python scripts/paper/prepare.py --out runs/paper

From examples/data/paper (complete Shakespeare + King James Bible, public domain, shipped
gzipped; `--corpora DIR` reads `NAME.txt` or `NAME.txt.gz` from another folder):
- data/{train,val}.jsonl: documents of ~2,000 characters cut at line ends; the last 5% of
  each corpus is the validation text (same distribution, never trained on);
- tokenizer/: a byte-level BPE of --vocab tokens trained on the training text only;
- mha-init/: a randomly initialised Llama with 8 query heads and 8 K/V heads (MHA), saved with
  the tokenizer, ready for `python -m uptrain.train configs/paper/pretrain-mha.yaml`.
Deterministic: same inputs and seed, same files.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# torch, tokenizers and transformers are imported where they are used: scripts/paper/run.py imports
# this module for CORPORA and corpus_path, and its --check and its refusals must not wait ~5 s for them.

CORPORA = ("shakespeare-complete.txt", "kjv-bible.txt")
SPECIAL = ["<|endoftext|>"]


def documents(text: str, size: int = 2000) -> list[str]:
    """Cut text into documents of about `size` characters at line ends (blank runs collapsed)."""
    docs, current = [], []
    length = 0
    for line in text.splitlines():
        if not line.strip() and (not current or not current[-1].strip()):
            continue
        current.append(line)
        length += len(line) + 1
        if length >= size:
            docs.append("\n".join(current).strip())
            current, length = [], 0
    if current:
        docs.append("\n".join(current).strip())
    return [d for d in docs if d]


def corpus_path(corpora: Path, name: str) -> Path:
    """`corpora/NAME` if present, else the shipped gzipped copy `corpora/NAME.gz`."""
    plain = corpora / name
    return plain if plain.is_file() else corpora / f"{name}.gz"


def read_corpus(path: Path) -> str:
    """The text of a corpus file, gunzipped when its name ends in .gz (same text either way)."""
    data = path.read_bytes()
    return (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")


def split_corpora(corpora: Path, out: Path, val_share: float) -> tuple[list[str], list[str]]:
    train, val = [], []
    for name in CORPORA:
        docs = documents(read_corpus(corpus_path(corpora, name)))
        cut = int(len(docs) * (1 - val_share))
        train += docs[:cut]
        val += docs[cut:]
    out.mkdir(parents=True, exist_ok=True)
    for split, docs in (("train", train), ("val", val)):
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
    return train, val


def train_tokenizer(texts: list[str], vocab: int) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE; <|endoftext|> is BOS, EOS and PAD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL[0], eos_token=SPECIAL[0],
                                   pad_token=SPECIAL[0], model_max_length=4096)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpora", type=Path, default=Path(__file__).resolve().parents[2] / "examples/data/paper")
    p.add_argument("--out", type=Path, default=Path("runs/paper"))
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    train, val = split_corpora(args.corpora, args.out / "data", val_share=0.05)
    tokenizer = train_tokenizer(train, args.vocab)
    tokenizer.save_pretrained(args.out / "tokenizer")
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.dim, intermediate_size=int(args.dim * 8 / 3) // 16 * 16,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      max_position_embeddings=args.ctx, tie_word_embeddings=True,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(args.out / "mha-init")
    tokenizer.save_pretrained(args.out / "mha-init")
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"train_docs": len(train), "val_docs": len(val), "vocab": len(tokenizer), "params": n,
                      "train_tokens": sum(len(tokenizer(d).input_ids) for d in train)}, indent=2))


if __name__ == "__main__":
    main()
