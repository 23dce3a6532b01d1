"""argparse types the commands share: a bad value is argparse's usage error (exit 2, the flag named), never a
traceback from deep inside the command or a value that silently means something else."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(minimum: int, zero_means: str | None = None) -> Callable[[str], int]:
    """An integer >= ``minimum``; ``zero_means`` names what 0 stands for where it is allowed ("all")."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            if zero_means is not None and minimum == 0:
                raise argparse.ArgumentTypeError(f"must be 0 ({zero_means}) or more, got {value}")
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def seconds(text: str) -> float:
    """A duration in seconds, finite and >= 0 (``nan`` ended ``pagedq submit --wait-s`` in a traceback, and
    a negative one gave up at once)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, 0 or more, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """A duration in seconds, finite and above 0: a deadline or an interval of 0 (or ``inf``) is no setting a
    user means, and ``pagedq batch --timeout-s inf`` failed every line only after the model had loaded."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text!r}")
    return value
