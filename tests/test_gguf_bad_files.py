"""Bad GGUF files fail as one ``GGUFError`` naming the file and the problem, from the header alone, before any
engine work (engine/checkpoint.py ``check_gguf``): the worker's model check (``resolve_model_path``) reports it
as ``worker.model_unavailable`` instead of a traceback minutes later, and gguf's memory-mapping reader never
sees a file whose tensors run past its end."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from engine.checkpoint import GGUFError, check_gguf
from engine.default_model import resolve_model_path
from engine.gguf_checkpoint import read_gguf_config
from tests.tiny_gguf import write_with_raw_tensors


def _write(
    path: Path,
    arch: str = "llama",
    tokenizer: bool = True,
    extra: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    split_count: int = 0,
) -> Path:
    """A small, well-formed GGUF: llama metadata, a tokenizer, an F32 embedding (and ``extra`` raw tensors)."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"t{i}" for i in range(16)])
    if split_count:
        writer.add_uint16("split.no", 0)
        writer.add_uint16("split.count", split_count)
    writer.add_tensor("token_embd.weight", np.ones((16, 32), dtype=np.float32))
    write_with_raw_tensors(writer, extra)
    return path


def test_a_file_is_read_once_per_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One load reads its header 4-5 times (worker, engine, config, weights, tokenizer): a file already read
    is not read again, and a file changed since (here cut short in place) is read again, and refused."""
    import engine.checkpoint

    reads: list[Path] = []
    read_header = engine.checkpoint._read_header

    def counted(file: BinaryIO, size: int, path: Path) -> engine.checkpoint.GGUFHeader:
        reads.append(path)
        return read_header(file, size, path)

    monkeypatch.setattr(engine.checkpoint, "_read_header", counted)
    path = _write(tmp_path / "once.gguf")
    check_gguf(path, require_tokenizer=False)
    check_gguf(path)
    assert check_gguf(path).field("general.architecture") == "llama"
    assert len(reads) == 1
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size - 64)
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        check_gguf(path)
    assert len(reads) == 2


def test_a_per_layer_array_is_refused_by_name(tmp_path: Path) -> None:
    """llama.cpp may write per-layer arrays (``head_count_kv``, ``feed_forward_length``); read as a number
    (the header keeps an array's length), a 2-layer array would have been 2 KV heads. Refused by name."""
    path = tmp_path / "per-layer.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_array("llama.attention.head_count_kv", [1, 2])
    writer.add_tensor("token_embd.weight", np.ones((16, 32), dtype=np.float32))
    write_with_raw_tensors(writer, None)
    with pytest.raises(GGUFError, match=r"llama\.attention\.head_count_kv is an array"):
        read_gguf_config(path)


def test_a_good_file_passes(tmp_path: Path) -> None:
    path = _write(tmp_path / "good.gguf")
    check_gguf(path)
    assert resolve_model_path(path) == path


@pytest.mark.parametrize(
    ("cut", "problem"),
    [
        (0, "does not start with the GGUF magic"),  # empty
        (3, "does not start with the GGUF magic"),
        (10, "truncated or corrupt"),  # inside the header's counts
        (60, "truncated or corrupt"),  # inside the metadata
        (-1, r"truncated or corrupt \(tensor token_embd\.weight ends at byte"),  # inside the tensor data
    ],
)
def test_truncated_file(tmp_path: Path, cut: int, problem: str) -> None:
    data = _write(tmp_path / "good.gguf").read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:cut])
    with pytest.raises(GGUFError, match=rf"short\.gguf.*{problem}"):
        resolve_model_path(short)  # the worker's model check
    with pytest.raises(GGUFError, match=r"short\.gguf"):
        read_gguf_config(short)  # the loader: never gguf's reader over a short memory map


def test_tensor_offset_past_the_end(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad-offset.gguf")
    data = bytearray(path.read_bytes())
    name = b"token_embd.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8 + 4  # after the name: n_dims, two dims, type -> offset
    data[at : at + 8] = struct.pack("<Q", 1 << 40)
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"bad-offset\.gguf.*tensor token_embd\.weight ends at byte"):
        resolve_model_path(path)


@pytest.mark.parametrize(("qtype", "block"), [(GGMLQuantizationType.IQ2_XXS, 66), (GGMLQuantizationType.TQ1_0, 54)])
def test_unsupported_type_names_tensor_and_type(tmp_path: Path, qtype: GGMLQuantizationType, block: int) -> None:
    raw = np.zeros((2, block), dtype=np.uint8)  # two 256-element blocks
    path = _write(tmp_path / "lattice.gguf", extra={"blk.0.ffn_down.weight": (raw, qtype)})
    with pytest.raises(GGUFError, match=rf"lattice\.gguf: tensor blk\.0\.ffn_down\.weight has type {qtype.name}"):
        resolve_model_path(path)


def test_unknown_architecture(tmp_path: Path) -> None:
    path = _write(tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(GGUFError, match=r"mamba\.gguf: GGUF architecture 'mamba' is not supported"):
        resolve_model_path(path)


def test_missing_tokenizer_metadata(tmp_path: Path) -> None:
    path = _write(tmp_path / "notok.gguf", tokenizer=False)
    with pytest.raises(GGUFError, match=r"notok\.gguf: GGUF has no tokenizer metadata"):
        resolve_model_path(path)
    check_gguf(path, require_tokenizer=False)  # the loader alone (tests' tiny files) does not need one


def test_text_file_named_gguf(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("not a model\n" * 20)
    with pytest.raises(GGUFError, match=r"notes\.gguf is not a GGUF file"):
        resolve_model_path(path)


def test_split_gguf_says_merge(tmp_path: Path) -> None:
    path = _write(tmp_path / "model-00001-of-00002.gguf", split_count=2)
    with pytest.raises(GGUFError, match=r"00001-of-00002\.gguf is part 1 of a GGUF split into 2 files.*merge"):
        resolve_model_path(path)


def test_gguf_error_is_what_the_worker_reports(tmp_path: Path) -> None:
    """worker/run.py's _model_problem turns ValueError into worker.model_unavailable (exit 78)."""
    assert issubclass(GGUFError, ValueError)
