"""Shared fixtures: tiny random-weight checkpoints (with a real byte-level BPE tokenizer)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.tiny_models import make_tiny_checkpoint
from tests.tiny_tokenizer import make_tokenizer

# Tests run tiny models (where thread start-up costs more than it saves) and often several
# processes at once (worker tests): one intra-op thread each avoids oversubscribing the cores,
# which with OpenMP's spinning threads slows everything down by an order of magnitude.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


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
