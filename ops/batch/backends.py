"""Where a batch's jobs run; the run loop sees only :class:`Backend`, so both ways give the same output.

* :class:`QueueBackend` (default): jobs go to ``<ns>:jobs:<queue>`` and however many workers serve that queue
  share them; this process only submits and collects results.
* :class:`LocalBackend` (``--local``): an engine in this process (on an
  :class:`~worker.engine_thread.EngineThread`), no Redis.

Each answer is described by what served it (:meth:`Backend.served_model`, :meth:`Backend.token_text`), not
by what this process was told: in queue mode the final event names its worker, and the worker's heartbeat
names its model, so a batch run with no ``--model`` or ``--tokenizer`` of its own still records the served
model and, when the worker's model folder is readable here, writes real token texts.
"""

from __future__ import annotations

import hashlib
import json
import queue
import sys
import uuid
from collections.abc import Collection
from pathlib import Path
from typing import Any, Protocol

from ops.batch.responses import TerminalEvent, TokenText, load_token_text, token_id_text
from schemas.affinity import shard_for_job
from schemas.jobs import ErrorEvent, JobRequest
from schemas.keys import JOB_FIELD, Keys
from worker.client import CANCEL_TTL_S, stored_end
from worker.redis_url import connect, is_cluster_client
from worker.registry import gets, live_heartbeats
from worker.settings import Settings


class Backend(Protocol):
    """Where jobs run: the queue (workers) or an engine in this process."""

    def submit(self, jobs: list[JobRequest]) -> None: ...
    def lost_jobs(self) -> bool:
        """Whether jobs submitted may have been lost since the last call (a Redis that came back without its
        data): the caller submits its outstanding jobs again, which their ids make harmless."""
        ...

    def forget(self, job_ids: Collection[str]) -> None:
        """Drop what is stored for these jobs (their failed results), so that they run again."""
        ...

    def cancel_earlier(self, output: Path) -> int:
        """Cancel the jobs earlier runs on ``output`` queued and never saw end (an ``--overwrite`` start, before
        :meth:`generation`: their answers would never be read); returns how many were asked to stop."""
        ...

    def generation(self, output: Path, fresh: bool) -> str:
        """The nonce of ``output``'s current run (part of every job id): a new one when ``fresh``
        (``--overwrite``), else the one the last fresh start chose, so that a resume finds its jobs."""
        ...

    def wait(self, ids: Collection[str], timeout_s: float) -> list[TerminalEvent]: ...
    def served_model(self, event: TerminalEvent) -> str:
        """The name of the model that answered ``event`` (an event :meth:`wait` returned)."""
        ...

    def token_text(self, event: TerminalEvent) -> TokenText:
        """Token id -> text with the tokenizer of the model that answered ``event`` (when there is one)."""
        ...

    def close(self) -> None: ...


def heartbeat_model(raw: str | bytes | None) -> str | None:
    """The ``model`` a worker's heartbeat JSON names, or None (no heartbeat, or not one pagedq wrote)."""
    try:
        beat = json.loads(raw) if raw else None
    except ValueError:
        return None
    model = beat.get("model") if isinstance(beat, dict) else None
    return model if isinstance(model, str) and model else None


MARKER_TTL_S = 7 * 86400
"""Life of a run's submission count and of OUTPUT's set of outstanding job ids in Redis, renewed as they are
used (a week: a batch may wait that long behind a backlog; those of a run that ended expire on its own)."""


def output_key(namespace: str, kind: str, output: Path) -> str:
    """``<ns>:batch-<kind>:<hash of OUTPUT's path>``: what runs on one OUTPUT hand on to the next (the path
    hashed: it may be long, and it is nobody else's business)."""
    return f"{namespace}:batch-{kind}:{hashlib.sha256(str(output).encode()).hexdigest()[:32]}"


def _stored_outcome(job_id: str, raw: str | bytes) -> TerminalEvent:
    """The terminal event stored at a job's result key; a key holding anything else (written by hand or by
    a foreign tool) ends the line as an ``internal`` error instead of ending the run with a traceback, or
    leaving the line waiting for an answer that is already "there"."""
    event = stored_end(raw, job_id)
    if event is not None:
        return event
    return ErrorEvent(
        id=job_id, attempt=0, code="internal", message="its result key holds no terminal event of this job"
    )


class QueueBackend:
    """Jobs through ``<ns>:jobs:<queue>``; results from ``<ns>:result:<id>`` (pipelined GETs), woken by a
    blocking XREAD on the jobs' reply streams (jobs are sent with ``stream: false``, so these hold only the
    terminal event).

    The served model of an answer is the model its worker's heartbeat names, read when its first answer
    comes (the worker is alive then, or was moments ago) and remembered; a worker whose heartbeat is gone
    (it exited before a resumed run collected its results) falls back to ``PAGEDQ_MODEL``, else ``pagedq``.
    """

    def __init__(self, url: str, settings: Settings, tokenizer: str | None) -> None:
        self.client = connect(url, decode_responses=True, socket_connect_timeout=5, socket_timeout=30)
        self.keys = Keys(settings.namespace, settings.queue, settings.queue_shards)
        self._namespace = settings.namespace
        self._result_ttl_s = settings.result_ttl_s
        self.default_model = settings.model or "pagedq"
        self._tokenizer = tokenizer  # --tokenizer: chosen by the user, so it wins over what workers report
        self._fallback_tokenizer = settings.model
        # Counts this run's submissions, INCRed in each submission's transaction: a Redis that lost them
        # (restarted without persistence, a failover to a replica without them) has a lower count or none.
        self._marker = f"{settings.namespace}:batch-run:{uuid.uuid4().hex}"
        self._submitted = 0  # the count Redis acknowledged
        # OUTPUT's in-flight set: the ids of the jobs runs on OUTPUT queued (this one, and an interrupted one
        # it resumes) whose end none has read yet, for an --overwrite start to cancel. Named by generation(),
        # which the run calls before it submits anything.
        self._inflight: str | None = None
        self._worker_models: dict[str, str] = {}  # worker name -> the model its heartbeat named
        self._texts: dict[str, TokenText] = {}  # tokenizer source -> token texts (token_id_text if it failed)

    def live_workers(self) -> int:
        """The queue's live workers, through the namespace's index (worker/registry.py), not a SCAN of every
        key in a Redis that other tenants share."""
        return len(live_heartbeats(self.client, self.keys.namespace, self.keys.queue))

    def submit(self, jobs: list[JobRequest]) -> None:
        if not jobs:
            return
        # All or nothing on one server: a retry after an error adds no duplicates. A cluster cannot make one
        # transaction of several shards' streams; there a retry may queue a job twice, which its id makes
        # harmless (one terminal event per id). The ids join OUTPUT's in-flight set in the same transaction as
        # their entries: no job is queued that a later --overwrite could not find to cancel.
        pipe = self.client.pipeline(transaction=not is_cluster_client(self.client))
        for job in jobs:
            pipe.xadd(self.keys.jobs_shard(shard_for_job(job, self.keys.shards)), {JOB_FIELD: job.to_json()})
        if self._inflight is not None:
            pipe.sadd(self._inflight, *(job.id for job in jobs))
            pipe.expire(self._inflight, MARKER_TTL_S)
        pipe.incr(self._marker)
        pipe.expire(self._marker, MARKER_TTL_S)
        self._submitted = int(pipe.execute()[-2])

    def forget(self, job_ids: Collection[str]) -> None:
        """Deletes the jobs' result keys and reply streams (``--retry-errors``): a job id has one terminal event,
        so as long as a failure is stored under the id, queueing the job again only reads the failure back."""
        pipe = self.client.pipeline(transaction=False)  # each job's keys have their own slot
        for job_id in job_ids:
            pipe.delete(self.keys.result(job_id), self.keys.reply(job_id))
        pipe.execute()

    def cancel_earlier(self, output: Path) -> int:
        """Cancels every id in ``<ns>:batch-inflight:<hash of OUTPUT's path>`` (the jobs earlier runs on
        OUTPUT queued and never saw end: an interrupted run leaves up to ``--max-in-flight`` of them), as
        :meth:`~worker.client.PagedqClient.cancel` does: the cancel key, then a notice on the cancel channel
        (a queued job ends ``cancelled`` when a worker reaches it, a running one stops within a second).
        The set is cleared only once every cancel is in: a Redis error before that keeps it, and the next
        ``--overwrite`` cancels them again (a cancel of a job that has ended meanwhile changes nothing)."""
        key = output_key(self._namespace, "inflight", output)
        ids = sorted(self.client.smembers(key))
        if not ids:
            return 0
        cluster = is_cluster_client(self.client)
        # Not a transaction: each job's cancel key has its own slot. A cluster pipeline refuses PUBLISH, so
        # there the notices go one command each, after every flag is set (workers also poll the flags).
        pipe = self.client.pipeline(transaction=False)
        for job_id in ids:
            pipe.set(self.keys.cancel(job_id), "1", ex=CANCEL_TTL_S)
            if not cluster:
                pipe.publish(self.keys.cancel_channel, job_id)
        pipe.execute()
        if cluster:
            for job_id in ids:
                self.client.publish(self.keys.cancel_channel, job_id)
        self.client.srem(key, *ids)  # not DEL: only what was cancelled leaves the set
        return len(ids)

    def generation(self, output: Path, fresh: bool) -> str:
        """Kept at ``<ns>:batch-output:<hash of OUTPUT's path>`` for as long as workers keep results: the
        results an ``--overwrite`` run left are under ids with its nonce, and a rerun without the flag must
        make the same ids to read them back instead of queueing every job again (the old jobs would still
        run, their answers never read). Expired together with those results, it makes no difference.

        Also names OUTPUT's in-flight set (:meth:`cancel_earlier`), which a resume keeps: it queues the same
        ids again, and waits for them."""
        self._inflight = output_key(self._namespace, "inflight", output)
        key = output_key(self._namespace, "output", output)
        if fresh:
            nonce = uuid.uuid4().hex
            self.client.set(key, nonce, ex=self._result_ttl_s)
            return nonce
        stored = self.client.getex(key, ex=self._result_ttl_s)
        return stored if isinstance(stored, str) else ""

    def lost_jobs(self) -> bool:
        """True when Redis's count of this run's submissions fell below the one it acknowledged: jobs
        queued by this run may be gone, and without their entries no worker would ever answer them."""
        if not self._submitted:
            return False
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self._marker)
        pipe.expire(self._marker, MARKER_TTL_S)
        if self._inflight is not None:  # renewed while the run waits behind a backlog (called when none came)
            pipe.expire(self._inflight, MARKER_TTL_S)
        count = int(pipe.execute()[0] or 0)
        if count >= self._submitted:
            return False
        self._submitted = count
        return True

    def _get_all(self, keys: list[str]) -> list[Any]:
        """GET of every key, 500 to a pipeline (:func:`worker.registry.gets`: not MGET, which a cluster refuses
        across slots)."""
        out: list[Any] = []
        for start in range(0, len(keys), 500):
            out += gets(self.client, keys[start : start + 500]).execute()
        return out

    def _results(self, ids: list[str]) -> list[TerminalEvent]:
        raws = self._get_all([self.keys.result(job_id) for job_id in ids])
        return [_stored_outcome(job_id, raw) for job_id, raw in zip(ids, raws, strict=True) if raw is not None]

    def wait(self, ids: Collection[str], timeout_s: float) -> list[TerminalEvent]:
        """Terminal events of some of ``ids`` (none after ``timeout_s``), their workers' models looked up,
        their ids out of OUTPUT's in-flight set (an ended job has nothing left to cancel)."""
        events = self._wait(list(ids), timeout_s)
        self._learn_models(events)
        self._ended(events)
        return events

    def _ended(self, events: list[TerminalEvent]) -> None:
        """SREM the ended jobs' ids. Done inside :meth:`wait`, so that a Redis outage here is waited out like
        any other: the events are read again on the next call (before their lines are written)."""
        if not events or self._inflight is None:
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.srem(self._inflight, *{e.id for e in events})
        pipe.expire(self._inflight, MARKER_TTL_S)
        pipe.execute()

    def _wait(self, wanted: list[str], timeout_s: float) -> list[TerminalEvent]:
        found = self._results(wanted)
        if found or not wanted:
            return found
        # The reply streams only wake the wait: what a job ended with is read from its result key, which
        # the worker writes atomically with the terminal event, while a reply stream holds whatever anyone
        # appended to it (an entry that is no event, a terminal event nobody confirmed).
        self.client.xread(self._wake_streams(wanted), count=1, block=max(1, int(timeout_s * 1000)))
        return self._results(wanted)

    def _wake_streams(self, wanted: list[str]) -> dict[Any, Any]:
        """The reply streams one blocking XREAD waits on (from their start): the first 1000 of ``wanted``.
        On a cluster only those in the slot of the first, the oldest job's (``wanted`` is in submission
        order, which the workers roughly follow, so it is the likeliest to end next): each job's reply
        stream has a hash tag of its own, and the cluster client refuses an XREAD across slots
        (``RedisClusterException``, the run's traceback as soon as two jobs were in flight). Jobs of other
        slots that end meanwhile are read when it wakes or times out (``pagedq batch`` waits a second)."""
        streams = [self.keys.reply(job_id) for job_id in wanted[:1000]]
        if is_cluster_client(self.client):
            slot = self.client.keyslot(streams[0])
            streams = [stream for stream in streams if self.client.keyslot(stream) == slot]
        return dict.fromkeys(streams, "0")

    def _learn_models(self, events: list[TerminalEvent]) -> None:
        """Read the heartbeats of workers not seen yet (:meth:`_get_all`). Done inside :meth:`wait`, so that
        a Redis outage here is waited out like any other; the events are read again on the next call."""
        unseen = sorted({e.worker for e in events if e.worker and e.worker not in self._worker_models})
        if not unseen:
            return
        beats = self._get_all([self.keys.heartbeat(name) for name in unseen])
        for name, raw in zip(unseen, beats, strict=True):
            model = heartbeat_model(raw)
            if model is not None:
                self._worker_models[name] = model

    def served_model(self, event: TerminalEvent) -> str:
        return self._worker_models.get(event.worker or "", self.default_model)

    def token_text(self, event: TerminalEvent) -> TokenText:
        """The tokenizer named by ``--tokenizer``, else the serving worker's model folder when it exists on
        this machine (same host, or a shared volume), else ``PAGEDQ_MODEL``'s; else token-id stand-ins."""
        served = self._worker_models.get(event.worker or "")
        source = self._tokenizer or (served if served and Path(served).is_dir() else None) or self._fallback_tokenizer
        if not source:
            return token_id_text
        if source not in self._texts:
            try:
                self._texts[source] = load_token_text(source)
            except Exception as exc:  # logprobs still usable as token ids
                print(
                    f"pagedq batch: cannot load tokenizer {source!r} ({exc}); "
                    "logprob tokens are written as token_id:<id>",
                    file=sys.stderr,
                )
                self._texts[source] = token_id_text
        return self._texts[source]

    def close(self) -> None:
        self.client.close()


class LocalBackend:
    """An engine in this process, stepped by an :class:`~worker.engine_thread.EngineThread`."""

    def __init__(self, settings: Settings) -> None:
        from worker.engine_thread import EngineThread
        from worker.run import build_engine

        engine: Any = build_engine(settings)
        self.engine = engine
        self.thread = EngineThread(engine, worker_name="local", max_num_seqs=settings.max_num_seqs).start()
        self.done: queue.SimpleQueue[TerminalEvent] = queue.SimpleQueue()
        # The name a worker of these settings reports (worker.consumer.Worker.model_name), so that a batch
        # run here and one run through the queue record the same model.
        self._served = settings.model or str(getattr(engine, "model_path", "pagedq"))

    def submit(self, jobs: list[JobRequest]) -> None:
        for job in jobs:
            handle = self.thread.submit(job)
            handle.future.add_done_callback(lambda f: self.done.put(f.result()))

    def wait(self, ids: Collection[str], timeout_s: float) -> list[TerminalEvent]:
        try:
            events = [self.done.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while True:
            try:
                events.append(self.done.get_nowait())
            except queue.Empty:
                return events

    def lost_jobs(self) -> bool:
        return False

    def forget(self, job_ids: Collection[str]) -> None:
        """Nothing outlives the process here."""

    def cancel_earlier(self, output: Path) -> int:
        """Nothing to cancel: an earlier run's jobs ran in its own process, and ended with it."""
        return 0

    def generation(self, output: Path, fresh: bool) -> str:
        """Nothing outlives the process here, so no run can find another's jobs."""
        return ""

    def served_model(self, event: TerminalEvent) -> str:
        return self._served

    def token_text(self, event: TerminalEvent) -> TokenText:
        tok = self.engine.tokenizer
        return lambda t: str(tok.decode([t]))

    def close(self) -> None:
        self.thread.stop()
