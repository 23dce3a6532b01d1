"""Helpers of the ops tests: a slow engine factory (to observe "not ready"), HTTP gets and metric parsing."""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from worker.settings import Settings


def slow_engine(settings: Settings) -> Any:
    """``engine_factory`` that waits ``$PAGEDQ_TEST_LOAD_DELAY_S`` (default 3 s) before building pagedq's
    engine, so a test can see the worker alive but not ready while "the model loads"."""
    time.sleep(float(os.environ.get("PAGEDQ_TEST_LOAD_DELAY_S", "3")))
    from worker.run import build_engine

    return build_engine(settings.model_copy(update={"engine_factory": None}))


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, str]:
    """(status, body) of GET http://127.0.0.1:port/path; (0, error) when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def metric_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> sample name -> [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(
        value
        for sample_labels, value in metric_samples(text).get(name, [])
        if all(sample_labels.get(k) == v for k, v in labels.items())
    )
