"""Write a SentencePiece `tokenizer.model` equivalent to a SentencePiece-style BPE `tokenizer.json`.

    python scripts/tools/make_spm_tokenizer.py examples/stories260K-mha8 [--check FILE...]

Why: llama.cpp's `convert_hf_to_gguf.py` reads a Llama vocabulary with its scores from
`tokenizer.model`; given only `tokenizer.json` it writes placeholder scores, and llama.cpp then
merges BPE pairs in a different order than transformers (the bundled stories260K scored 17.2
instead of 4.9 perplexity from raw text). This script rebuilds the SentencePiece model that the
`tokenizer.json` was converted from: the same pieces in the same ids, scores that give the merge
priority of the `merges` list (SentencePiece's BPE merges the adjacent pair whose concatenation
has the highest score; transformers' the pair of lowest merge rank; with score = -rank of the first
merge producing a piece, the two orders agree), byte pieces `<0x00>`..`<0xFF>` as BYTE, and the
normalizer the `tokenizer.json` spells out (prepend "▁", spaces to "▁", nothing else).

Only the shape of tokenizer.json that transformers writes for a SentencePiece BPE model is accepted
(model BPE with byte_fallback, normaliser Prepend("▁") + Replace(" ", "▁"), no pre-tokeniser);
anything else is a one-line error, exit 2. `--check FILE...` also proves the result: every line of
each file (.txt or .txt.gz) is tokenized by sentencepiece and by transformers' tokenizer of the
folder, and the first difference is an error. Needs transformers' copy of SentencePiece's protobuf
schema (and `protobuf`); `--check` needs `sentencepiece`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

SPACE = "\u2581"  # SentencePiece's visible space, "▁"
# sentencepiece_model.proto's ModelProto.SentencePiece.Type
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


class NotSentencePieceBPE(ValueError):
    """The tokenizer.json is not the shape this script can convert (message says which part)."""


def pieces_from_tokenizer_json(tok: dict) -> list[tuple[str, float, int]]:
    """The SentencePiece pieces of a transformers SentencePiece-BPE tokenizer.json, in id order.

    Returns [(piece, score, type)] with len == vocab size. Scores: a piece made by a merge gets
    -rank of the first merge that makes it (merges are listed by priority); a piece no merge makes
    (single characters) ranks after all merged ones, in id order; special and byte pieces get 0,
    as SentencePiece's trainer writes them.
    """
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        raise NotSentencePieceBPE("model is not a byte-fallback BPE")
    norm = tok.get("normalizer") or {}
    steps = norm.get("normalizers", [norm]) if norm.get("type") == "Sequence" else [norm]
    expected = [("Prepend", SPACE), ("Replace", " ")]
    seen = [(s.get("type"), s.get("prepend") or (s.get("pattern") or {}).get("String")) for s in steps]
    if seen != expected or steps[1].get("content") != SPACE:
        raise NotSentencePieceBPE(f"normalizer is {seen}, not Prepend('▁') then Replace(' ', '▁')")
    if tok.get("pre_tokenizer") is not None:
        raise NotSentencePieceBPE("it has a pre_tokenizer (a SentencePiece BPE has none)")
    vocab: dict[str, int] = model["vocab"]
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    if [i for _, i in by_id] != list(range(len(by_id))):
        raise NotSentencePieceBPE("vocab ids are not 0..n-1")
    rank: dict[str, int] = {}
    for r, merge in enumerate(model.get("merges", [])):
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        rank.setdefault(a + b, r)
    special = {t["content"] for t in tok.get("added_tokens", []) if t.get("special")}
    unk = model.get("unk_token")
    out: list[tuple[str, float, int]] = []
    next_unmerged = len(model.get("merges", []))  # below every merged piece's score
    for piece, _ in by_id:
        if piece == unk:
            out.append((piece, 0.0, UNKNOWN))
        elif piece in special:
            out.append((piece, 0.0, CONTROL))
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append((piece, 0.0, BYTE))
        elif piece in rank:
            out.append((piece, -float(rank[piece]), NORMAL))
        else:
            out.append((piece, -float(next_unmerged), NORMAL))
            next_unmerged += 1
    return out


def model_proto(pieces: list[tuple[str, float, int]], tok: dict):
    """A sentencepiece ModelProto (BPE, byte fallback, identity normaliser with a dummy prefix)."""
    from transformers.utils import sentencepiece_model_pb2_new as pb  # SentencePiece's schema

    m = pb.ModelProto()
    for piece, score, kind in pieces:
        p = m.pieces.add()
        p.piece, p.score, p.type = piece, score, kind
    ids = {piece: i for i, (piece, _, _) in enumerate(pieces)}
    specials = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    t = m.trainer_spec
    t.model_type = pb.TrainerSpec.BPE
    t.vocab_size = len(pieces)
    t.byte_fallback = True
    t.unk_id = ids.get(tok["model"].get("unk_token"), 0)
    t.bos_id = specials.get("<s>", -1)
    t.eos_id = specials.get("</s>", -1)
    t.pad_id = -1
    n = m.normalizer_spec
    n.name = "identity"  # no NFKC: tokenizer.json has no Unicode normalisation step
    n.add_dummy_prefix = True  # Prepend("▁")
    n.remove_extra_whitespaces = False  # tokenizer.json keeps runs of spaces
    n.escape_whitespaces = True  # Replace(" ", "▁")
    return m


def text_lines(paths: list[Path]) -> list[str]:
    """Every non-empty line of the files (.gz read as gzip), then every blank-line-separated block
    (documents as uptrain reads them, with their inner newlines)."""
    lines: list[str] = []
    blocks: list[str] = []
    for path in paths:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        text = raw.decode("utf-8")
        lines += [ln for ln in text.split("\n") if ln]
        blocks += [b for b in text.split("\n\n") if b.strip()]
    return lines + blocks


def check(folder: Path, model_file: Path, lines: list[str]) -> int:
    """Compare sentencepiece's ids with transformers' on each line; return the number of lines."""
    import sentencepiece
    from transformers import AutoTokenizer

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    hf = AutoTokenizer.from_pretrained(folder)
    for n, line in enumerate(lines):
        want = hf(line, add_special_tokens=False)["input_ids"]
        got = sp.encode(line)
        if got != want:
            raise NotSentencePieceBPE(f"line {n} tokenizes differently: {line[:60]!r}: spm {got[:12]} vs transformers {want[:12]}")
    return len(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a model folder with tokenizer.json")
    parser.add_argument("-o", "--out", type=Path, help="where to write (default FOLDER/tokenizer.model)")
    parser.add_argument("--check", type=Path, nargs="*", default=[], help="text files whose lines must tokenize alike")
    args = parser.parse_args(argv)
    src = args.folder / "tokenizer.json"
    if not src.is_file():
        print(f"make_spm_tokenizer: {src} not found; give a model folder with a tokenizer.json", file=sys.stderr)
        return 2
    tok = json.loads(src.read_text(encoding="utf-8"))
    try:
        proto = model_proto(pieces_from_tokenizer_json(tok), tok)
    except NotSentencePieceBPE as e:
        print(f"make_spm_tokenizer: {src}: {e}; only SentencePiece-style BPE tokenizers can be converted", file=sys.stderr)
        return 2
    out = args.out or args.folder / "tokenizer.model"
    out.write_bytes(proto.SerializeToString())
    print(f"wrote {out}: {len(proto.pieces)} pieces")
    if args.check:
        try:
            n = check(args.folder, out, text_lines(args.check))
        except NotSentencePieceBPE as e:
            print(f"make_spm_tokenizer: {e}", file=sys.stderr)
            return 1
        print(f"checked: sentencepiece == transformers on all {n} lines of {len(args.check)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
