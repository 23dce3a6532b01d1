"""The house rules of the import graph, checked on the source (``ast``), so a violation fails before review.

Layers point down only: ``ops`` → ``worker`` → ``engine`` → ``pagedq_kernels``, with ``schemas`` (the wire protocol)
below everything but ``pagedq_kernels``. A producer that imports the client loads neither torch nor the engine.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# What each top-level package may import from the project (itself always allowed).
ALLOWED: dict[str, set[str]] = {
    "pagedq_kernels": set(),
    "schemas": set(),
    "engine": {"pagedq_kernels", "schemas"},
    "worker": {"engine", "pagedq_kernels", "schemas"},
    "ops": {"worker", "engine", "pagedq_kernels", "schemas"},
}


def project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level project package) of every import in ``path``, including ones inside functions."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, name.split(".")[0]) for name in names if name.split(".")[0] in ALLOWED]
    return found


def upward_edges() -> list[str]:
    edges = []
    for package, allowed in ALLOWED.items():
        for path in sorted((REPO / package).rglob("*.py")):
            for line, target in project_imports(path):
                if target != package and target not in allowed:
                    edges.append(f"{path.relative_to(REPO)}:{line} imports {target} ({package} may import {allowed})")
    return edges


def test_no_module_imports_a_higher_layer() -> None:
    assert upward_edges() == []


def test_the_walk_sees_imports_inside_functions(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("import os\n\ndef f():\n    from ops.cli import main\n    import worker.client, json\n")
    assert project_imports(source) == [(4, "ops"), (5, "worker")]


@pytest.mark.parametrize(
    "statement",
    [
        "from worker.client import PagedqClient, AsyncPagedqClient, JobFailed, Restart",
        "import schemas.jobs, schemas.keys, schemas.sampling",
    ],
)
def test_producer_imports_load_no_torch(statement: str) -> None:
    """A producer process (a web backend) imports the client in a fresh interpreter: no torch, no engine."""
    code = (
        f"import sys\n{statement}\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy', 'engine', 'ops') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"the import loaded {out.stdout.strip()}"


def test_no_installed_distribution_shares_a_top_level_name() -> None:
    """A top-level package of ours that another installed distribution also provides shadows it for
    whoever imports it: transformers 5.25 made Hugging Face's ``kernels`` a dependency and imports it at
    start, and found pagedq's former ``kernels`` package instead (ImportError at ``import transformers``)."""
    from importlib.metadata import packages_distributions

    providers = packages_distributions()
    shared = {name: providers[name] for name in ALLOWED if set(providers.get(name, [])) - {"pagedq"}}
    assert shared == {}
