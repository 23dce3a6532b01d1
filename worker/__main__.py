"""``python -m worker [--redis-url URL] [--model PATH] [--queue NAME] [--name NAME] ...``

Every setting of :class:`worker.settings.Settings` is a flag (``--max-num-seqs 8``) and an env var
(``PAGEDQ_MAX_NUM_SEQS=8``); flags win. ``pagedq worker`` in ``ops/cli.py`` is the same thing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from worker.settings import Settings, SettingsError, load_settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedq worker", description="Run a pagedq worker.")
    parser.add_argument("--print-config", action="store_true", help="print the effective settings and exit")
    parser.add_argument("--config", default=None, help="TOML or JSON settings file (also PAGEDQ_CONFIG)")
    for name, info in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = info.description or ""
        if info.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    print_config = args.pop("print_config")
    config = args.pop("config")
    try:
        settings = load_settings(config, **args)
    except SettingsError as exc:
        print(f"pagedq worker: {exc}", file=sys.stderr)
        return 2
    if print_config:
        print(json.dumps(settings.redacted(), indent=2, default=str))
        return 0
    from worker.run import run_worker

    return run_worker(settings)


if __name__ == "__main__":
    sys.exit(main())
