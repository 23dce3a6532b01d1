"""Prometheus metrics of one worker, in a registry of its own, all prefixed ``pagedq_`` and in base units.

Why a dedicated :class:`~prometheus_client.CollectorRegistry` per worker rather than the global one: tests
(and embedders) run several workers in one process, and each ``/metrics`` must show only its own counts,
so that the per-replica job counts of a fleet add up to the jobs submitted.

Two kinds of metrics:

* **event metrics** (histograms and counters of finished jobs) are fed by the worker loop through
  :meth:`WorkerMetrics.job_finished` and :meth:`WorkerMetrics.delivery`. They only touch prometheus-client
  objects, which are thread-safe, so the loop never blocks on a scrape. The latency histograms hold
  completed jobs only (:data:`COMPLETED_REASONS`); every ending is counted in ``pagedq_jobs_total``.
* **state metrics** (running/waiting requests, KV usage, engine counters, reconnects, stream backlog) are
  read at scrape time from the worker's ``status`` snapshot (a dict the loop replaces as the engine's load
  changes) and from a Redis probe of the HTTP thread. Scrapes therefore never call into the engine, which
  is not thread-safe; a gauge is as current as that snapshot.

Conventions taken from vLLM's and other serving stacks' exporters, so that their dashboards and alerts carry
over:

* no ``*_created`` series (:func:`prometheus_client.disable_created_metrics`): one timestamp series beside
  every counter and histogram doubles what is stored and says nothing a restart does not;
* ``pagedq_worker_info{model, version, dtype}`` (always 1): what this replica serves, to join on;
* a ``model_name`` label on the engine's metrics (requests, KV cache, prefix cache, tokens, latencies, jobs),
  so a fleet serving several models on one Prometheus keeps them apart. The name is the one the worker
  reports in its heartbeat; it is known once the model is loaded (:meth:`WorkerMetrics.set_model`), and
  is empty before that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "pagedq_"
MODEL_LABEL = "model_name"

# Latency buckets (seconds): LLM jobs span milliseconds (a cached short prompt) to minutes (a long
# generation queued behind others), so the buckets are roughly logarithmic over that range.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# The finish reasons of a job that ran to its own end (a stop token or string, or its token limit). Only
# these jobs are observed in the latency histograms: a job cancelled or cut by its deadline ends when
# someone outside decided, so its "latency" measures the caller's patience, not the service, and a burst of
# cancels would drag the percentiles operators alert on. After vLLM v1, which observes its e2e/queue/
# prefill/decode histograms from finished-request stats and labels request_success_total by finished_reason;
# pagedq says outright which endings count as finished, and counts the others in pagedq_jobs_total.
COMPLETED_REASONS: frozenset[str] = frozenset({"stop", "length"})

StatusSource = Callable[[], Mapping[str, Any]]
StreamSource = Callable[[], "tuple[int, int] | None"]


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def pagedq_version() -> str:
    """The installed pagedq's version (``unknown`` when run from a tree that was never installed)."""
    try:
        return metadata.version("pagedq")
    except metadata.PackageNotFoundError:
        return "unknown"


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``bfloat16``: the label value, whatever form it came in."""
    return str(dtype).removeprefix("torch.")


class WorkerMetrics:
    """All metrics of one worker. Create it first, then :meth:`bind` the status and stream sources, and
    :meth:`set_model` once the model is loaded."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # Process-wide in prometheus-client; read at every scrape, so calling it here covers every metric.
        disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = ""
        self.info: dict[str, str] | None = None  # the labels of pagedq_worker_info, once the model is loaded
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(PREFIX + name, doc, [MODEL_LABEL], buckets=buckets, registry=r)

        self.ttft = histogram(
            "time_to_first_token_seconds",
            "Time from enqueue (stream entry id) to the first generated token, of completed jobs "
            "(finish reason stop or length).",
        )
        self.inter_token = histogram(
            "inter_token_latency_seconds",
            "Time between generated tokens of completed jobs (each contributes its mean gap once per gap).",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds",
            "Time from enqueue to the terminal event of completed jobs (finish reason stop or length).",
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time from enqueue to the start in the engine, of completed jobs."
        )
        self.jobs = Counter(
            PREFIX + "jobs",
            "Jobs ended by this worker, by outcome (final/error) and reason (finish reason or error code); "
            "rejected, cancelled and timed-out jobs included.",
            [MODEL_LABEL, "outcome", "reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished jobs.", [MODEL_LABEL], registry=r
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens of finished jobs.", [MODEL_LABEL], registry=r
        )
        self.redeliveries = Counter(
            PREFIX + "redeliveries", "Deliveries of a job beyond its first (retries, reclaims).", registry=r
        )
        self.dead_letters = Counter(
            PREFIX + "dead_letters", "Jobs this worker dead-lettered (rejected ones included).", registry=r
        )
        self._state = _StateCollector(self)
        r.register(self._state)

    def set_model(self, model_name: str, dtype: object) -> None:
        """What this worker serves, once its model is loaded: the ``model_name`` label of the engine's
        metrics and ``pagedq_worker_info``. ``dtype`` is what the engine computes in (``auto`` resolved).

        The series of the event metrics are created here, at zero, so that a dashboard
        sees them (and ``rate()`` has a starting point) before the first job ends."""
        self.model_name = model_name
        self.info = {"model": model_name, "version": pagedq_version(), "dtype": dtype_name(dtype)}
        labelled = (self.ttft, self.inter_token, self.e2e, self.queue_time, self.prompt_tokens, self.generation_tokens)
        for metric in labelled:
            metric.labels(model_name=model_name)

    def bind(self, status: StatusSource | None = None, stream: StreamSource | None = None) -> None:
        """Where scrape-time state comes from: the worker's status snapshot and a (backlog, pending) probe."""
        if status is not None:
            self._state.status = status
        if stream is not None:
            self._state.stream = stream

    # ------------------------------------------------------------------- called by the worker loop

    def delivery(self, attempt: int) -> None:
        """A job was delivered (``attempt`` counts from 1): count it when it is a redelivery."""
        if attempt > 1:
            self.redeliveries.inc()

    def job_finished(
        self,
        *,
        outcome: str,
        reason: str | None,
        queued_s: float | None = None,
        ttft_s: float | None = None,
        total_s: float | None = None,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        dead_lettered: bool = False,
    ) -> None:
        """Record one ended job: every ending in ``pagedq_jobs_total`` by outcome and ``reason``, the
        tokens of every ``final`` (the engine did that work, cancelled or not), and the latency histograms
        only for completed jobs.

        ``reason`` is the job's finish reason for a ``final`` (its worst: ``cancelled`` or ``deadline`` if
        any of its choices was stopped from outside) and the error code for an ``error``."""
        model = self.model_name
        self.jobs.labels(model_name=model, outcome=outcome, reason=reason or "unknown").inc()
        if dead_lettered:
            self.dead_letters.inc()
        if outcome != "final":
            return
        self.prompt_tokens.labels(model_name=model).inc(max(0, prompt_tokens))
        self.generation_tokens.labels(model_name=model).inc(max(0, completion_tokens))
        # The rule (see COMPLETED_REASONS): latency histograms observe only jobs that finished ``stop`` or
        # ``length``. Errors, rejections, cancels and deadlines would skew the distributions users alert
        # on; they stay in view in pagedq_jobs_total{outcome, reason}, counted above.
        if reason not in COMPLETED_REASONS:
            return
        queued, ttft, total = _finite(queued_s), _finite(ttft_s), _finite(total_s)
        if queued is not None:
            self.queue_time.labels(model_name=model).observe(queued)
        if ttft is not None:
            self.ttft.labels(model_name=model).observe(ttft)
        if total is not None:
            self.e2e.labels(model_name=model).observe(total)
        if ttft is not None and total is not None and completion_tokens > 1:
            gap = max(0.0, total - ttft) / (completion_tokens - 1)
            inter_token = self.inter_token.labels(model_name=model)
            for _ in range(min(completion_tokens - 1, 4096)):
                inter_token.observe(gap)


class _StateCollector(Collector):
    """Scrape-time gauges and counters read from the worker's status snapshot and the stream probe."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self.status: StatusSource = dict
        self.stream: StreamSource = lambda: None

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unchecked collector: the set of series depends on what the worker has reported

    def collect(self) -> Iterator[Metric]:
        st = self.status() or {}
        model = self.metrics.model_name
        info = self.metrics.info

        def from_status(kind: Any, name: str, doc: str, key: str, engine: bool) -> Iterator[Metric]:
            """One sample of ``kind`` (gauge or counter family) from status field ``key``, if present;
            engine metrics carry the model label."""
            if isinstance(st.get(key), (int, float)):
                if not engine:
                    yield kind(PREFIX + name, doc, value=float(st[key]))
                    return
                family = kind(PREFIX + name, doc, labels=[MODEL_LABEL])
                family.add_metric([model], float(st[key]))
                yield family

        def gauge(name: str, doc: str, key: str, engine: bool = True) -> Iterator[Metric]:
            return from_status(GaugeMetricFamily, name, doc, key, engine)

        def counter(name: str, doc: str, key: str, engine: bool = True) -> Iterator[Metric]:
            return from_status(CounterMetricFamily, name, doc, key, engine)

        if info is not None:
            family = GaugeMetricFamily(PREFIX + "worker_info", "What this worker serves (always 1).", labels=list(info))
            family.add_metric(list(info.values()), 1.0)
            yield family
        yield from gauge("requests_running", "Requests running in the engine.", "running")
        yield from gauge("requests_waiting", "Requests waiting in the engine's scheduler.", "waiting")
        yield from gauge("jobs_unstarted", "Jobs read from Redis, not yet in the engine.", "unstarted", engine=False)
        yield from gauge("kv_cache_usage_ratio", "Share of KV cache blocks in use (0-1).", "kv_cache_usage")
        yield from counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                           "prefix_cache_queries")  # fmt: skip
        yield from counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits")
        yield from counter("preemptions", "Requests preempted by the engine for lack of KV blocks.",
                           "num_preemptions")  # fmt: skip
        yield from counter("spec_draft_tokens", "Draft tokens verified by speculative decoding.",
                           "spec_draft_tokens")  # fmt: skip
        yield from counter("spec_accepted_tokens", "Draft tokens accepted (decode steps saved).",
                           "spec_accepted_tokens")  # fmt: skip
        yield from counter("redis_reconnects", "Times the worker got Redis back after losing it.",
                           "jobs_reconnects", engine=False)  # fmt: skip
        yield from counter("duplicate_deliveries", "Deliveries of jobs that had already ended (acked only).",
                           "jobs_duplicate", engine=False)  # fmt: skip
        # In the heartbeat (jobs_lost) since the start, but not here: the one sign on a dashboard that a
        # worker was presumed dead (a stall past reclaim_idle_s) and others ran its jobs. Not part of
        # pagedq_jobs_total, whose terminal events the other delivery writes and counts.
        yield from counter("jobs_lost", "Held jobs dropped because another delivery took over or ended them.",
                           "jobs_lost", engine=False)  # fmt: skip
        yield GaugeMetricFamily(
            PREFIX + "worker_draining", "1 while the worker drains for shutdown.",
            value=1.0 if st.get("state") == "draining" else 0.0,
        )  # fmt: skip
        probe = self.stream()
        if probe is not None:
            backlog, pending = probe
            yield GaugeMetricFamily(PREFIX + "stream_backlog_entries",
                                    "Entries in the jobs stream (not started plus pending; ended jobs are deleted).",
                                    value=float(backlog))  # fmt: skip
            yield GaugeMetricFamily(PREFIX + "stream_pending_entries",
                                    "Entries delivered to the group and not yet acknowledged (all workers).",
                                    value=float(pending))  # fmt: skip
