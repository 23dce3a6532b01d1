"""The worker's HTTP port, end to end: real ``python -m worker`` processes with the tiny model.

* ``/readyz`` is 503 while the model loads (a slow engine factory) and 200 once the group is joined;
  ``/healthz`` is already 200 then, since the process is alive and Redis answers.
* ``/healthz`` turns 503 within 5 s of Redis going away and 200 again after it returns.
* ``/metrics`` counts the worker's jobs, and its JSON log has one canonical ``job.finished`` line per
  job, with no prompt text in any line.
* ``/metrics`` counts every terminal outcome, rejected and dead-lettered jobs included, by outcome and error
  code: the counts add up to the entries submitted, and the dead letters to the dead-letter stream.
* ``/metrics`` follows the serving stacks' conventions (no ``*_created`` series, ``pagedq_worker_info``, a
  ``model_name`` label on the engine's metrics), and a scrape right after the last result was published
  shows an idle engine.
* ``/healthz`` of an unreachable ``redis+cluster://`` URL is a 503 with the password masked (the probe's
  making used to raise), and every metric family follows Prometheus' naming conventions.
* the latency histograms hold completed jobs only (finish reason ``stop`` or ``length``): a cancelled,
  timed-out or failed job is counted in ``pagedq_jobs_total`` by its reason and observed in no histogram,
  through the ledger and through a real worker cancelling a job mid-generation.
"""

from __future__ import annotations

import json
import socket
import time
from collections import Counter
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from schemas.jobs import Choice, ErrorEvent, FinalEvent, FinishReason, JobRequest, Timings, TokenEvent, Usage
from schemas.keys import JOB_FIELD, Keys
from tests.ops_helpers import http_get, metric_samples, metric_sum
from tests.redis_servers import DEBIAN_VARIANT_SLOW, RedisServer, free_port, fresh_redis_server, redis_server  # noqa: F401
from tests.tiny_gguf import write_small_gguf
from tests.worker_harness import Ctx, WorkerProcess, inprocess_worker, job_counts, logs_shown_on_failure, wait_for
from worker.consumer import EngineLike
from worker.health import PROBE_CACHE_S, HealthServer, RedisProbe
from worker.job_ledger import JobLedger
from worker.metrics import WorkerMetrics

SECRET = "zebra-quasar-7731"  # in every prompt; must never reach the log


@pytest.fixture(scope="session")
def model_dir(tiny_model: Any) -> Path:
    return Path(tiny_model("llama_gqa"))


def _start(ctx: Ctx, model: Path, tmp: Path, name: str, **settings: Any) -> tuple[WorkerProcess, int]:
    port = free_port()
    proc = WorkerProcess(ctx, model, tmp, name, metrics_port=port, **settings)
    return proc, port


@pytest.fixture
def fresh_ctx(fresh_redis_server: RedisServer) -> Iterator[Ctx]:  # noqa: F811
    c = Ctx(fresh_redis_server)
    yield c
    c.close()


@pytest.fixture
def ctx(redis_server: RedisServer) -> Iterator[Ctx]:  # noqa: F811
    c = Ctx(redis_server)
    yield c
    c.close()


@pytest.mark.parametrize("redis_server", DEBIAN_VARIANT_SLOW, indirect=True)
@pytest.mark.parametrize("model", ["incomplete-folder", "gguf-without-a-size", "gguf-the-engine-refuses"])
def test_a_model_that_cannot_load_is_a_config_error_in_one_line(ctx: Ctx, tmp_path: Path, model: str) -> None:
    """``--model`` naming an incomplete folder: exit 78 with what is missing, before torch loads, not a
    traceback from transformers (which blamed a missing sentencepiece for an absent tokenizer). The same for a
    GGUF without a size its config needs (found by the model check: it was int(None)'s traceback and exit 1)
    and for one the check passes and the engine refuses (rope scaling pagedq does not run: exit 1 too)."""
    if model == "incomplete-folder":
        path = tmp_path / "incomplete"
        path.mkdir()
        (path / "config.json").write_text("{}")
        problems = ["no *.safetensors weights", "no tokenizer"]
    elif model == "gguf-without-a-size":
        path = write_small_gguf(tmp_path / "nosize.gguf", omit=("block_count",))
        problems = [f"{path}: GGUF metadata is missing llama.block_count"]
    else:
        path = write_small_gguf(tmp_path / "yarn.gguf", metadata={"llama.rope.scaling.type": "yarn"})
        problems = [f"{path}: rope scaling 'yarn' is not supported"]
    proc = WorkerProcess(ctx, path, tmp_path, "no-model")
    with logs_shown_on_failure(proc.log, proc.close):
        assert proc.proc.wait(timeout=60) == 78
        lines = proc.log_lines()
        (line,) = [x for x in lines if x.get("event") == "worker.model_unavailable"]
        assert all(problem in line["error"] for problem in problems), line
        assert not any("exception" in x for x in lines)


@pytest.mark.parametrize("redis_server", DEBIAN_VARIANT_SLOW, indirect=True)
def test_a_metrics_port_in_use_is_a_config_error_before_the_model_loads(
    ctx: Ctx, model_dir: Path, tmp_path: Path
) -> None:
    """A second worker on a host with the same --metrics-port: exit 78 (EX_CONFIG) with a line that names
    the port and the fix, not a traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = WorkerProcess(ctx, model_dir, tmp_path, "port-clash", metrics_port=port)
        with logs_shown_on_failure(proc.log, proc.close):
            assert proc.proc.wait(timeout=60) == 78
            lines = proc.log_lines()
            (line,) = [x for x in lines if x.get("event") == "worker.metrics_port_unavailable"]
            assert line["port"] == port and "--metrics-port" in line["hint"]
            assert "engine ready" not in [x.get("event") for x in lines]
            assert not any("exception" in x for x in lines)


@pytest.mark.slow  # a worker process through a Redis stop and restart (~13 s)
@pytest.mark.parametrize("fresh_redis_server", DEBIAN_VARIANT_SLOW, indirect=True)
def test_ready_after_load_and_health_follows_redis(
    fresh_ctx: Ctx, model_dir: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setenv("PAGEDQ_TEST_LOAD_DELAY_S", "4")
    proc, port = _start(fresh_ctx, model_dir, tmp_path, "w-health", engine_factory="tests.ops_helpers:slow_engine")
    with logs_shown_on_failure(proc.log, proc.close):
        # the port opens before the model loads: alive and healthy, not ready
        status, _ = wait_for(lambda: (s := http_get(port, "/healthz"))[0] and s, 60, 0.05, "the metrics port")
        assert status == 200
        code, body = http_get(port, "/readyz")
        assert code == 503, body
        assert "loading" in body
        wait_for(lambda: http_get(port, "/readyz")[0] == 200, 90, 0.1, "/readyz 200")
        proc.wait_ready()

        fresh_ctx.server.stop()  # returns once the server process has exited
        gone = time.monotonic()
        # /healthz answers from a PING cached for PROBE_CACHE_S; once that is older, the PING fails at once
        # (nothing listens). So every probe *asked for* later than the cache age plus a margin (a PONG read
        # late on a loaded machine) must be 503, however slowly it is answered: the promise of 5 s, checked
        # without timing the answers. The polling goes on until such a probe was answered.
        stale_after = gone + 2 * PROBE_CACHE_S + 0.5
        assert stale_after - gone < 5.0
        answers: list[tuple[float, int]] = []  # (asked at, status) of each answered /healthz since Redis stopped

        def probe_after_the_cache() -> bool:
            asked = time.monotonic()
            code = http_get(port, "/healthz")[0]
            if code:  # 0: no answer within http_get's timeout (a stalled machine); ask again
                answers.append((asked, code))
            return bool(code) and asked >= stale_after

        wait_for(probe_after_the_cache, 60, 0.1, "a /healthz asked for after the probe cache went stale")
        late = [code for asked, code in answers if asked >= stale_after]
        assert late and set(late) == {503}, answers
        codes = [code for _, code in answers]
        assert 200 not in codes[codes.index(503) :], answers  # unhealthy once, then it stays so while Redis is down
        went_unhealthy_s = next(asked for asked, code in answers if code == 503) - gone
        assert http_get(port, "/readyz")[0] == 200  # readiness is about the model and group, not Redis
        fresh_ctx.server.start()
        wait_for(lambda: http_get(port, "/healthz")[0] == 200, 30.0, 0.1, "/healthz 200 after Redis returned")
        print(f"healthz unhealthy {went_unhealthy_s:.2f}s after Redis went away")
        assert proc.proc.poll() is None
        assert proc.terminate() == 0


@pytest.mark.slow  # a worker process scraped after a run (~9 s); the outcome counts stay default
@pytest.mark.parametrize("redis_server", DEBIAN_VARIANT_SLOW, indirect=True)
def test_metrics_and_canonical_log_lines(ctx: Ctx, model_dir: Path, tmp_path: Path) -> None:
    proc, port = _start(ctx, model_dir, tmp_path, "w-logs")
    try:
        proc.wait_ready()
        prompts = [f"{SECRET} question number {i}" for i in range(12)]
        ids = ctx.client.submit_many(prompts, max_tokens=4, temperature=0.0)
        wait_for(lambda: all(c == (1, True) for c in job_counts(ctx.redis, ctx.keys, ids).values()), 90, 0.1, "jobs")
        text = wait_for(
            lambda: (t := http_get(port, "/metrics")[1]) and metric_sum(t, "pagedq_jobs_total") == len(ids) and t,
            10, 0.1, "metrics to count the jobs",
        )  # fmt: skip
        assert metric_sum(text, "pagedq_jobs_total", outcome="final") == len(ids)
        assert metric_sum(text, "pagedq_generation_tokens_total") == 4 * len(ids)
        assert metric_sum(text, "pagedq_prompt_tokens_total") > 0
        assert metric_sum(text, "pagedq_time_to_first_token_seconds_count") == len(ids)
        assert metric_sum(text, "pagedq_e2e_request_latency_seconds_count") == len(ids)
        assert metric_sum(text, "pagedq_request_queue_time_seconds_count") == len(ids)
        assert metric_sum(text, "pagedq_inter_token_latency_seconds_count") == 3 * len(ids)
        for name in (
            "pagedq_requests_running",
            "pagedq_kv_cache_usage_ratio",
            "pagedq_stream_pending_entries",
            "pagedq_stream_backlog_entries",
            "pagedq_prefix_cache_queries_total",
            "pagedq_redis_reconnects_total",
            "pagedq_redeliveries_total",
            "pagedq_dead_letters_total",
        ):
            assert name in text, name  # fmt: skip
        assert proc.terminate() == 0
    finally:
        proc.close()
    raw = proc.log_path.read_text()
    assert SECRET not in raw, "prompt text leaked into the log"
    lines = proc.log_lines()
    finished = [line for line in lines if line.get("event") == "job.finished"]
    assert Counter(line["job_id"] for line in finished) == Counter(ids), "one canonical line per job"
    for line in finished:
        assert line["worker"] == "w-logs" and line["outcome"] == "final"
        for key in (
            "queued_s",
            "ttft_s",
            "total_s",
            "prompt_tokens",
            "completion_tokens",
            "tok_s",
            "finish_reason",
            "attempt",
        ):
            assert key in line, (key, line)  # fmt: skip
        assert line["completion_tokens"] == 4 and line["finish_reason"] == "length" and line["attempt"] == 1


@pytest.mark.slow  # a worker process through valid, invalid and dead-lettered jobs, then scraped (~9 s)
@pytest.mark.parametrize("redis_server", DEBIAN_VARIANT_SLOW, indirect=True)
def test_every_terminal_outcome_and_dead_letter_is_counted(ctx: Ctx, model_dir: Path, tmp_path: Path) -> None:
    proc, port = _start(ctx, model_dir, tmp_path, "w-outcomes")
    with logs_shown_on_failure(proc.log, proc.close):
        proc.wait_ready()
        good = ctx.client.submit_many(["one", "two", "three"], max_tokens=3, ignore_eos=True, temperature=0.0)
        long_ago = time.time() - 3600  # a sane submitted_at (not in the future, not a month old), long past
        bad: dict[str, tuple[str, bool]] = {  # payload -> (error code, dead-lettered)
            "{not json": ("invalid_request", True),
            json.dumps({"id": "bad-type", "prompt": "x", "max_tokens": "8"}): ("invalid_request", True),
            json.dumps({"id": "bad-field", "prompt": "x", "bogus": 1}): ("invalid_request", True),
            json.dumps({"id": "too-long", "prompt": "x" * 4000}): ("prompt_too_long", True),
            json.dumps({"id": "bad-reply", "prompt": "x", "reply_to": "elsewhere:stream"}): ("invalid_request", True),
            json.dumps({"id": "late", "prompt": "x", "timeout_s": 1, "submitted_at": long_ago}): (
                "deadline_exceeded",
                False,
            ),
        }
        for payload in bad:
            ctx.redis.xadd(ctx.keys.jobs, {JOB_FIELD: payload})
        with_ids = [*good, "bad-type", "bad-field", "too-long", "bad-reply", "late"]
        dead = sum(is_dead for _, is_dead in bad.values())

        def all_answered() -> bool:
            results = job_counts(ctx.redis, ctx.keys, with_ids).values()
            return all(has_result for _, has_result in results) and ctx.redis.xlen(ctx.keys.dead) == dead

        # The ledger counts a job when its terminal write is queued, before it is sent: once Redis has every
        # result and dead letter, /metrics has counted them all.
        wait_for(all_answered, 90, 0.1, "every job answered and every dead letter written")
        text = http_get(port, "/metrics")[1]
        submitted = len(good) + len(bad)
        assert metric_sum(text, "pagedq_jobs_total") == submitted, text
        assert metric_sum(text, "pagedq_jobs_total", outcome="final", reason="length") == len(good)
        want_errors = Counter(code for code, _ in bad.values())
        got_errors = {
            labels["reason"]: value
            for labels, value in metric_samples(text)["pagedq_jobs_total"]
            if labels["outcome"] == "error"
        }
        assert got_errors == {code: float(n) for code, n in want_errors.items()}
        assert metric_sum(text, "pagedq_dead_letters_total") == dead == ctx.redis.xlen(ctx.keys.dead)
        assert proc.terminate() == 0


ENGINE_METRICS = (
    "pagedq_requests_running",
    "pagedq_requests_waiting",
    "pagedq_kv_cache_usage_ratio",
    "pagedq_prefix_cache_queries_total",
    "pagedq_prefix_cache_hits_total",
    "pagedq_preemptions_total",
    "pagedq_prompt_tokens_total",
    "pagedq_generation_tokens_total",
    "pagedq_time_to_first_token_seconds_count",
    "pagedq_inter_token_latency_seconds_count",
    "pagedq_e2e_request_latency_seconds_count",
    "pagedq_request_queue_time_seconds_count",
    "pagedq_jobs_total",
)


@pytest.mark.slow  # a worker process scraped right after a batch (~8 s)
@pytest.mark.parametrize("redis_server", DEBIAN_VARIANT_SLOW, indirect=True)
def test_metrics_conventions_and_gauges_current_right_after_the_work(ctx: Ctx, model_dir: Path, tmp_path: Path) -> None:
    proc, port = _start(ctx, model_dir, tmp_path, "w-conventions")
    with logs_shown_on_failure(proc.log, proc.close):
        proc.wait_ready()
        # More jobs than max_num_seqs, all of one length: the engine runs full batches until the last ends.
        ids = ctx.client.submit_many([f"job {i}" for i in range(10)], max_tokens=8, ignore_eos=True, temperature=0.0)
        wait_for(lambda: all(c == (1, True) for c in job_counts(ctx.redis, ctx.keys, ids).values()), 90, 0.05, "jobs")
        text = http_get(port, "/metrics")[1]  # at once: the last results were published a moment ago
        samples = metric_samples(text)
        for name in ("pagedq_requests_running", "pagedq_requests_waiting", "pagedq_jobs_unstarted"):
            assert [value for _, value in samples[name]] == [0.0], (name, samples[name])
        assert [value for _, value in samples["pagedq_kv_cache_usage_ratio"]] == [0.0]
        assert metric_sum(text, "pagedq_jobs_total", outcome="final") == len(ids)

        assert "_created" not in text
        assert samples["pagedq_worker_info"] == [
            ({"model": str(model_dir), "version": metadata.version("pagedq"), "dtype": "float32"}, 1.0)
        ]
        for name in ENGINE_METRICS:
            assert samples.get(name), name
            assert {labels.get("model_name") for labels, _ in samples[name]} == {str(model_dir)}, name
        assert proc.terminate() == 0


def test_healthz_of_an_unreachable_cluster_is_503_with_the_password_masked() -> None:
    """A cluster client connects as it is made and says "no node answers" with a ``RedisClusterException``,
    which is not a ``RedisError``: the probe's making raised (a worker with --metrics-port and its cluster
    down could not start the port), and a probe once made would drop the request instead of answering."""
    secret = "Zq8-cluster-pw"
    probe = RedisProbe(f"redis+cluster://:{secret}@127.0.0.1:{free_port()}", Keys("ns", "default"))
    server = HealthServer("127.0.0.1", 0, WorkerMetrics(), probe).start()
    try:
        status, body = http_get(server.port, "/healthz")
        assert status == 503 and "redis unreachable (redis+cluster://:***@127.0.0.1:" in body, body
        assert "RedisClusterUnreachableError" in body and secret not in body
        status, text = http_get(server.port, "/metrics")
        assert status == 200 and "pagedq_worker_draining 0.0" in text
        assert "pagedq_stream_backlog_entries" not in text  # unknown while Redis is away, not a made-up 0
    finally:
        server.stop()


def test_every_metric_follows_the_prometheus_conventions() -> None:
    """What an operator's recording rules assume, over every family a worker exposes once it has a status
    and has ended jobs: ``pagedq_`` names, counters ending ``_total``, latency as ``_seconds`` histograms,
    no per-job label, ratios within 0-1; and ``jobs_lost`` (in the heartbeat since the start) exported."""
    metrics = WorkerMetrics()
    metrics.set_model("m", "float32")
    status = {
        "state": "ready", "running": 1, "waiting": 2, "unstarted": 3, "kv_cache_usage": 0.25,
        "prefix_cache_queries": 10, "prefix_cache_hits": 4, "num_preemptions": 1, "spec_draft_tokens": 8,
        "spec_accepted_tokens": 5, "jobs_reconnects": 1, "jobs_duplicate": 1, "jobs_lost": 2,
    }  # fmt: skip
    metrics.bind(status=lambda: status, stream=lambda: (7, 3))
    metrics.job_finished(outcome="final", reason="stop", queued_s=0.1, ttft_s=0.2, total_s=0.5, completion_tokens=4)
    metrics.job_finished(outcome="error", reason="invalid_request", dead_lettered=True)
    text = generate_latest(metrics.registry).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert metric_sum(text, "pagedq_jobs_lost_total") == 2
    assert metric_sum(text, "pagedq_stream_backlog_entries") == 7
    for name, family in families.items():
        assert name.startswith("pagedq_"), name
        labels = {label for sample in family.samples for label in sample.labels}
        assert not labels & {"id", "job", "job_id", "entry_id"}, (name, labels)
        if family.type == "counter":
            assert all(sample.name == name + "_total" for sample in family.samples), name
        if family.type == "histogram":
            assert name.endswith("_seconds"), name
        if name.endswith("_ratio"):
            assert all(0 <= sample.value <= 1 for sample in family.samples), name
    assert {f.type for f in families.values()} == {"counter", "gauge", "histogram"}


LATENCY_COUNTS = (
    "pagedq_time_to_first_token_seconds_count",
    "pagedq_e2e_request_latency_seconds_count",
    "pagedq_request_queue_time_seconds_count",
)


class _Log:
    """The ledger's job logger: keeps the ``job.finished`` lines it is given."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append({"event": event, **fields})


def _final(job_id: str, reasons: list[FinishReason], total_s: float) -> FinalEvent:
    choices = [Choice(index=i, text="ab", token_ids=[1, 2], finish_reason=r) for i, r in enumerate(reasons)]
    return FinalEvent(
        id=job_id,
        attempt=1,
        choices=choices,
        usage=Usage(prompt_tokens=3, completion_tokens=2 * len(reasons)),
        timings=Timings(queued_s=0.1, ttft_s=0.2, total_s=total_s),
        worker="w",
    )


def test_latency_histograms_observe_completed_jobs_only() -> None:
    """The ledger over the real registry: one job completed (``length``) beside jobs stopped from outside,
    each ended minutes after enqueue. The histograms hold the completed job alone (its e2e sum is its own
    0.5 s), and every other ending is in ``pagedq_jobs_total`` by reason; an ``n`` = 2 job whose first
    sample hit a stop token before the cancel is a cancelled job, not a completed one. Their tokens still
    count (the engine did that work)."""
    metrics = WorkerMetrics()
    metrics.set_model("m", "float32")
    ledger = JobLedger(log_prompts=False)
    ledger.metrics = metrics
    log = _Log()
    request = JobRequest(id="j", prompt="p")
    ledger.ended(log, request, _final("done", ["length"], total_s=0.5), dead_lettered=False)
    ledger.ended(log, request, _final("cancelled", ["cancelled"], total_s=120.0), dead_lettered=False)
    ledger.ended(log, request, _final("timed-out", ["deadline"], total_s=300.0), dead_lettered=False)
    ledger.ended(log, request, _final("half-cancelled", ["stop", "cancelled"], total_s=200.0), dead_lettered=False)
    cancelled_early = ErrorEvent(id="early", attempt=1, code="cancelled", message="before a token", worker="w")
    ledger.ended(log, request, cancelled_early, dead_lettered=False)
    text = generate_latest(metrics.registry).decode()
    for name in LATENCY_COUNTS:
        assert metric_sum(text, name, model_name="m") == 1, (name, text)
    assert metric_sum(text, "pagedq_e2e_request_latency_seconds_sum") == 0.5
    assert metric_sum(text, "pagedq_inter_token_latency_seconds_count") == 1  # 2 tokens: one gap
    jobs = {(labels["outcome"], labels["reason"]): value for labels, value in metric_samples(text)["pagedq_jobs_total"]}
    assert jobs == {
        ("final", "length"): 1,
        ("final", "cancelled"): 2,
        ("final", "deadline"): 1,
        ("error", "cancelled"): 1,
    }
    assert metric_sum(text, "pagedq_generation_tokens_total") == 2 + 2 + 2 + 4
    reasons = [line.get("finish_reason") for line in log.lines if line["outcome"] == "final"]
    assert reasons == ["length", "cancelled", "deadline", "cancelled"]  # the log line agrees with the label


@pytest.mark.parametrize("redis_server", DEBIAN_VARIANT_SLOW, indirect=True)
def test_a_worker_cancelling_a_job_mid_generation_keeps_it_out_of_the_latency_histograms(
    ctx: Ctx, engine: EngineLike
) -> None:
    """A real worker and Redis: one job completes, another is cancelled once its tokens stream. The
    histograms of the worker's registry hold the completed job alone, with its own end-to-end time; the
    cancel is counted as ``final``/``cancelled``, and its tokens as generated."""
    metrics = WorkerMetrics()
    # step_delay_s keeps the long job generating for ~18 s unless cancelled; the test waits on its tokens.
    with inprocess_worker(ctx, engine, step_delay_s=0.02) as worker:
        metrics.set_model(worker.model_name, "float32")
        worker.ledger.metrics = metrics  # as worker/run.py does; no job has ended yet
        done = ctx.client.result(ctx.client.submit("short", max_tokens=4, ignore_eos=True, temperature=0), timeout=60)
        long = ctx.client.submit("long", max_tokens=900, ignore_eos=True, temperature=0)
        wait_for(lambda: any(isinstance(e, TokenEvent) for e in ctx.events(long)), what="the long job's tokens")
        ctx.client.cancel(long)
        cancelled = ctx.client.result(long, timeout=30)
    assert done.choices[0].finish_reason == "length"
    assert cancelled.choices[0].finish_reason == "cancelled" and cancelled.usage.completion_tokens > 0
    # The ledger counts a job when its terminal write is queued, before the result is readable: both are in.
    text = generate_latest(metrics.registry).decode()
    assert metric_sum(text, "pagedq_jobs_total", outcome="final", reason="cancelled") == 1
    assert metric_sum(text, "pagedq_jobs_total", outcome="final", reason="length") == 1
    for name in LATENCY_COUNTS:
        assert metric_sum(text, name) == 1, (name, text)
    assert metric_sum(text, "pagedq_e2e_request_latency_seconds_sum") == done.timings.total_s
    assert metric_sum(text, "pagedq_inter_token_latency_seconds_count") == 3
    generated = done.usage.completion_tokens + cancelled.usage.completion_tokens
    assert metric_sum(text, "pagedq_generation_tokens_total") == generated
