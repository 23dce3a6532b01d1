"""The fixed English text pagedq's quantisation quality is measured on (README, "Quantisation").

Built from documentation shipped with the Python interpreter itself, so every machine with the same Python
version builds the same text without a download: Python's ``LICENSE.txt``, then the docstrings (module,
classes, functions, in source order, via ``ast``) of a fixed list of standard-library files. The list and
the order are part of the measurement: change them and every recorded perplexity changes.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

# Relative to the standard library folder (sysconfig's "stdlib"; Python 3.11 here).
SOURCE_FILES: tuple[str, ...] = (
    "LICENSE.txt",
    "argparse.py",
    "subprocess.py",
    "re/__init__.py",
    "statistics.py",
    "collections/__init__.py",
    "json/__init__.py",
    "textwrap.py",
    "difflib.py",
    "unittest/case.py",
    "functools.py",
    "threading.py",
    "logging/__init__.py",
    "inspect.py",
    "typing.py",
    "pathlib.py",
    "shutil.py",
    "tarfile.py",
    "zipfile.py",
    "datetime.py",
)
MIN_TOKENS = 20_000


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _docstrings(source: str) -> list[str]:
    tree = ast.parse(source)
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc and len(doc.split()) >= 8:  # one-liners are mostly signatures, not prose
                docs.append(doc)
    return docs


def build_text() -> str:
    """The whole text (every file's part, in :data:`SOURCE_FILES` order, separated by blank lines)."""
    parts: list[str] = []
    for name in SOURCE_FILES:
        path = stdlib_dir() / name
        text = path.read_text(encoding="utf-8")
        parts.extend([text] if name.endswith(".txt") else _docstrings(text))
    return "\n\n".join(p.strip() for p in parts)


def build_tokens(tokenizer: object, min_tokens: int = MIN_TOKENS) -> list[int]:
    """The text's token ids (no special tokens); raises if this Python's files give fewer than ``min_tokens``."""
    ids: list[int] = tokenizer(build_text(), add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    if len(ids) < min_tokens:
        raise RuntimeError(f"the perplexity text has {len(ids)} tokens, fewer than {min_tokens}")
    return ids
