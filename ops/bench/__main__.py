"""``python -m ops.bench [options]``: the same as ``pagedq bench``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ops.bench import add_arguments, run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedq bench", description="Benchmark pagedq against its peers.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
