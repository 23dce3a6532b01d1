"""Shared fixtures: tiny random-weight checkpoints (with a real byte-level BPE tokenizer)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_checkpoint
from tests.tiny_tokenizer import make_tokenizer


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model(arch)`` -> folder of a tiny checkpoint with tokenizer, built once per session."""
    built: dict[str, Path] = {}

    def get(arch: str = "llama_gqa") -> Path:
        if arch not in built:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            make_tiny_checkpoint(path, arch)
            make_tokenizer(path)
            built[arch] = path
        return built[arch]

    return get
