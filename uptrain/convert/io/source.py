"""Reading a source checkpoint: resolve a local folder or Hub id, list its tensors, read one at a time.

Only metadata is read up front (names, shapes, dtypes from safetensors headers). `read` loads a
single tensor, so converting never holds the whole model. `.bin` files are read only through
`torch.load(weights_only=True, mmap=True)` (no pickled code runs; one file mapped at a time) and
only when no safetensors exist.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open

# missing_folder_hint: imported from here by uptrain.measure
from uptrain.convert.io.early import missing_folder_hint, near_folder, not_a_hub_id  # noqa: F401
from uptrain.convert.io.passthrough import SAFE_INDEX, StoredTensor, read_header
from uptrain.errors import UsageError

BIN_INDEX = "pytorch_model.bin.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".pkl")

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}

# What a Hub download fetches: everything a converted folder needs except weights of the other format.
_HUB_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "LICENSE*", "*.md"]


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's name, shape and dtype, without its data."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def stored(self) -> StoredTensor:
        """The same tensor as a safetensors header names it (what `shards.ShardWriter` plans with)."""
        return StoredTensor(self.name, self.shape, DTYPE_NAMES[self.dtype])


@dataclass(frozen=True)
class TensorInfo(TensorSpec):
    """A source tensor's metadata and the file holding it; for safetensors also where its bytes are."""

    file: Path = Path()
    offset: int | None = None  # byte offset of the raw data in `file` (safetensors), else None


BIN_REMAP_BYTES = 32 * 2**20


@dataclass
class _BinMapping:
    """One memory-mapped `.bin` file and how many bytes were read through this mapping."""

    file: Path
    tensors: dict[str, torch.Tensor]
    mapped: bool  # False: a legacy (non-zip) file, loaded whole; kept until the next file
    read_bytes: int = 0


@dataclass
class SourceCheckpoint:
    """A checkpoint folder's config (raw config.json) and the metadata of all its tensors."""

    path: Path
    config: dict[str, Any]
    format: Literal["safetensors", "bin"]
    tensors: list[TensorInfo]
    _bin_map: _BinMapping | None = field(default=None, repr=False)

    def read(self, info: TensorInfo) -> torch.Tensor:
        """Load one tensor. Safetensors files are opened per tensor so no mapping outlives it;
        `.bin` files are memory-mapped one at a time and re-mapped every `BIN_REMAP_BYTES` read,
        so the mapped pages that count in this process's RSS stay near one tensor too."""
        if self.format == "safetensors":
            try:
                with safe_open(info.file, framework="pt") as f:
                    return f.get_tensor(info.name)
            except SafetensorError as err:
                raise UsageError(f"cannot read {info.name} from {info.file.name}: {err}; "
                                 f"the file is truncated or corrupted, download it again") from err
        mapping = self._bin_map
        if (mapping is None or mapping.file != info.file
                or (mapping.mapped and mapping.read_bytes + info.nbytes > BIN_REMAP_BYTES)):
            self._bin_map = None  # unmapped once the caller drops the tensors it was given
            mapping = self._bin_map = _BinMapping(info.file, *_load_bin(info.file))
        mapping.read_bytes += info.nbytes
        return mapping.tensors[info.name]


def resolve_source(ckpt: str, revision: str | None = None, weights: bool = True) -> Path:
    """A local checkpoint folder, or a Hub model id downloaded (or found in the cache) by huggingface_hub.

    weights=False fetches only config.json and the safetensors index: for `--dry-run`,
    whose tensor list then comes from the safetensors headers (`open_hub_headers`).
    """
    local = Path(ckpt).expanduser()
    if local.exists():
        if not local.is_dir():
            raise UsageError(f"{ckpt} is a file; pass the checkpoint folder that holds config.json")
        return local.resolve()
    if near := near_folder(ckpt):  # a typo of a local folder, not a Hub id
        raise UsageError(f"no folder {ckpt}; did you mean {near}?")
    if not_a_hub_id(ckpt):
        raise UsageError(f"checkpoint folder {ckpt} does not exist; check the path")
    from huggingface_hub import snapshot_download

    with hub_errors(ckpt, revision):
        if not weights:  # the plan needs the config and the index, nothing else
            return Path(snapshot_download(ckpt, revision=revision, allow_patterns=["config.json", SAFE_INDEX]))
        folder = Path(snapshot_download(ckpt, revision=revision, allow_patterns=_HUB_PATTERNS + ["*.safetensors"]))
        if not any(folder.glob("*.safetensors")):
            folder = Path(snapshot_download(ckpt, revision=revision, allow_patterns=_HUB_PATTERNS + ["*.bin"]))
    return folder


@contextmanager
def hub_errors(ckpt: str, revision: str | None) -> Iterator[None]:
    """huggingface_hub's errors inside the block as one-line UsageErrors that say what to do."""
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    try:
        yield
    except HFValidationError as err:
        raise UsageError(f"{ckpt!r} is neither a local folder nor a valid Hub model id") from err
    except (RepositoryNotFoundError, GatedRepoError) as err:
        raise UsageError(f"Hub model {ckpt!r} not found or not accessible; check the id or log in "
                         f"with `hf auth login`") from err
    except RevisionNotFoundError as err:
        raise UsageError(f"Hub model {ckpt!r} has no revision {revision!r}") from err
    except (LocalEntryNotFoundError, OSError) as err:  # OfflineModeIsEnabled is a ConnectionError
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:  # the Hub was not tried: do not blame the network
            raise UsageError(f"{ckpt!r} (revision {revision or 'main'}) is not a local folder and not in the "
                             f"local Hub cache (offline: HF_HUB_OFFLINE=1); download it with the Hub reachable "
                             f"and HF_HUB_OFFLINE unset, or pass a local checkpoint folder") from err
        raise UsageError(f"cannot reach the Hugging Face Hub and {ckpt!r} (revision {revision or 'main'}) "
                         f"is not in the local cache; download it where the Hub is reachable, or pass "
                         f"a local checkpoint folder") from err


def hub_model_id(ckpt: str, folder: Path) -> str | None:
    """The Hub id of a source: `ckpt` itself when it was resolved on the Hub, or the id of a
    huggingface_hub cache snapshot folder (.../models--ORG--NAME/snapshots/REV); else None."""
    if not Path(ckpt).expanduser().exists():
        return ckpt
    parts = folder.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return None


def has_weights(folder: Path) -> bool:
    """Whether a folder holds weight files (safetensors or .bin) at all."""
    return any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))


def open_hub_headers(repo_id: str, revision: str | None, folder: Path,
                     config: dict[str, Any]) -> tuple[SourceCheckpoint, int]:
    """The tensor list of a Hub checkpoint from its safetensors headers alone, and the bytes fetched.

    huggingface_hub's `get_safetensors_metadata` reads each shard's header with HTTP range
    requests (the first 100 kB, more only for a larger header), never the weights. The tensors
    point at files in `folder` that do not exist locally: this source can be planned, not read.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import NotASafetensorsRepoError

    with count_hub_bytes() as fetched, hub_errors(repo_id, revision):
        try:
            meta = HfApi().get_safetensors_metadata(repo_id, revision=revision)
        except NotASafetensorsRepoError as err:
            raise UsageError(f"Hub model {repo_id!r} has no safetensors weights, so a dry run cannot read "
                             f"tensor shapes without downloading them; run without --dry-run") from err
    infos = []
    for filename, file_meta in sorted(meta.files_metadata.items()):
        for name, t in file_meta.tensors.items():
            if t.dtype not in SAFETENSORS_DTYPES:
                raise UsageError(f"{filename}: tensor {name} has dtype {t.dtype}, which uptrain does not read")
            infos.append(TensorInfo(name, tuple(t.shape), SAFETENSORS_DTYPES[t.dtype], folder / filename))
    return SourceCheckpoint(folder, config, "safetensors", infos), fetched[0]


@contextmanager
def count_hub_bytes() -> Iterator[list[int]]:
    """Bytes of response bodies huggingface_hub receives inside the block (`[n]`, filled on exit).

    Counted from each GET response's Content-Length through an event hook of huggingface_hub's
    own HTTP client (HEAD responses carry no body).
    """
    from huggingface_hub.utils import get_session

    client, total = get_session(), [0]

    def hook(response: Any) -> None:
        if response.request.method != "HEAD":
            total[0] += int(response.headers.get("content-length") or 0)

    before = client.event_hooks
    client.event_hooks = {**before, "response": [*before.get("response", []), hook]}
    try:
        yield total
    finally:
        client.event_hooks = before


def _load_bin(file: Path) -> tuple[dict[str, torch.Tensor], bool]:
    """A `.bin` state dict, memory-mapped (True) or, for legacy non-zip files, loaded whole (False)."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True), True
    except RuntimeError:  # legacy (non-zip) .bin files cannot be memory-mapped
        return torch.load(file, map_location="cpu", weights_only=True), False
    except Exception as err:  # unpickling refused or corrupt archive
        raise UsageError(f"cannot read {file.name} safely ({type(err).__name__}); "
                         f"convert it to safetensors first") from err


def _indexed_files(folder: Path, index_name: str) -> dict[str, Path]:
    """tensor name -> shard path from an index file, refusing shards outside the folder."""
    try:
        weight_map = json.loads((folder / index_name).read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise UsageError(f"{index_name} is not a valid index (no weight_map); fix or remove it") from err
    files: dict[str, Path] = {}
    root = Path(os.path.abspath(folder))
    for name, shard in weight_map.items():
        # Normalised, not resolved: in a huggingface_hub cache every file is a symlink into blobs/.
        path = Path(os.path.normpath(root / shard))
        if path.parent != root:
            raise UsageError(f"{index_name} names shard {shard!r} outside the checkpoint folder; refusing it")
        if not path.is_file():
            raise UsageError(f"{index_name} names shard {shard!r}, which is missing; download it again")
        files[name] = path
    return files


def _data_offsets(file: Path) -> dict[str, int]:
    """tensor name -> absolute byte offset of its data, from the safetensors header.

    The file is `u64 header length | JSON header | data`; `data_offsets` count from the data start.
    Called after `safe_open` has validated the header (offsets within the file, no overlaps).
    """
    header, start = read_header(file)
    return {k: start + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def _safetensors_infos(name_to_file: dict[str, Path] | None, files: list[Path]) -> list[TensorInfo]:
    infos: list[TensorInfo] = []
    wanted = None if name_to_file is None else set(name_to_file)
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                offsets = _data_offsets(file)
                for name in f.keys():
                    if wanted is not None and name_to_file.get(name) != file:
                        continue
                    s = f.get_slice(name)
                    infos.append(TensorInfo(name, tuple(s.get_shape()), SAFETENSORS_DTYPES[s.get_dtype()], file,
                                            offsets[name]))
        except SafetensorError as err:
            raise UsageError(f"{file.name} is not a readable safetensors file ({err}); "
                             f"it is truncated or corrupted, download it again") from err
    if wanted is not None:
        missing = wanted - {i.name for i in infos}
        if missing:
            raise UsageError(f"the index names {len(missing)} tensor(s) missing from their shards "
                             f"(e.g. {sorted(missing)[0]}); the checkpoint is incomplete")
    return infos


def read_config(folder: Path) -> dict[str, Any]:
    """The raw config.json of a checkpoint folder (UsageError when missing or not JSON)."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise UsageError(f"{folder} has no config.json; pass a Hugging Face checkpoint folder")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise UsageError(f"{config_path} is not valid JSON ({err.msg}, line {err.lineno})") from err


def open_checkpoint(folder: Path, config: dict[str, Any] | None = None) -> SourceCheckpoint:
    """The config (read here unless given) and the tensor metadata of a checkpoint folder."""
    config = read_config(folder) if config is None else config
    if (folder / SAFE_INDEX).is_file():
        name_to_file = _indexed_files(folder, SAFE_INDEX)
        files = sorted(set(name_to_file.values()))
        return SourceCheckpoint(folder, config, "safetensors", _safetensors_infos(name_to_file, files))
    safetensors_files = sorted(folder.glob("*.safetensors"))
    if safetensors_files:
        return SourceCheckpoint(folder, config, "safetensors", _safetensors_infos(None, safetensors_files))
    if (folder / BIN_INDEX).is_file():
        bin_files = sorted(set(_indexed_files(folder, BIN_INDEX).values()))
    else:
        bin_files = sorted(folder.glob("pytorch_model*.bin"))
    if not bin_files:
        raise UsageError(f"{folder} has no weights (*.safetensors or pytorch_model*.bin); "
                         f"download the weight files too")
    infos: list[TensorInfo] = []
    for file in bin_files:  # one file mapped at a time; only shapes are read, no tensor data
        infos += [TensorInfo(name, tuple(t.shape), t.dtype, file) for name, t in _load_bin(file)[0].items()]
    return SourceCheckpoint(folder, config, "bin", infos)


def auxiliary_files(folder: Path) -> list[Path]:
    """Files to copy beside the converted weights: tokenizer, generation config, licences.

    Not copied: weights and their indexes, config.json and README.md (both rewritten), and
    Python files (remote code is never carried along).
    """
    skip = {"config.json", "README.md", SAFE_INDEX, BIN_INDEX}
    return sorted(p for p in folder.iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.name not in skip
                  and p.suffix not in WEIGHT_SUFFIXES and p.suffix != ".py")
