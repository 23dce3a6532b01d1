"""``pagedq submit``, ``pagedq status`` and ``pagedq dead list|replay``: a producer and an operator's view.

Each command is a pair ``add_<cmd>_arguments(parser)`` / ``run_<cmd>(args) -> exit code`` that ``ops/cli.py``
wires in; ``python -m ops.queue_commands <cmd> ...`` runs them without it (tests use that).

Everything here goes through wire protocol v1 (``README.md``, "Wire protocol v1") and the key names of
``schemas/keys.py``: these commands are plain Redis clients, they never talk to a worker directly. Settings
(``--redis-url``, ``--namespace``, ``--queue``) default to the same ``PAGEDQ_*`` environment the worker
reads, so on one machine ``pagedq worker`` and ``pagedq submit`` find each other without flags; with no
Redis URL at all, the embedded Redis of the default data folder is used, as the worker does.

Exit codes: 0 success (``status`` included when it warns, e.g. of a key of the wrong type, but read all the
rest), 1 the job failed or Redis is unreachable, 2 bad arguments, 124 ``--wait-s`` ran out
(600 s unless given: a first ``submit`` with no worker running must not wait silently forever), 130
interrupted (``submit`` cancels its job on Ctrl-C), 141 stdout was closed early (``| head``), as a C tool
killed by SIGPIPE would report, without a traceback.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import signal
import sys
import textwrap
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import redis
from pydantic import ValidationError
from redis.exceptions import RedisClusterException

from ops.arg_types import int_at_least, seconds
from schemas.jobs import JOB_ID_PATTERN, DeadLetter, FinalEvent, describe_validation_error, salvage_reply_target
from schemas.keys import GROUP, JOB_FIELD, OWNER_FIELD, Keys, entry_ref, split_entry_ref
from worker import redis_url
from worker.redis_url import is_cluster_client
from worker.registry import heartbeat_keys, index_members, live_heartbeats
from worker.settings import Settings, SettingsError, load_settings, mask_url

# ------------------------------------------------------------------------------------------ common


def add_connection_arguments(parser: argparse.ArgumentParser, *, queue_help: str | None = None) -> None:
    """``--redis-url``, ``--namespace`` and ``--queue``; unset ones come from ``PAGEDQ_*`` then defaults."""
    parser.add_argument(
        "--redis-url",
        default=None,
        help="redis://, rediss:// or unix:// URL "
        "(default: $PAGEDQ_REDIS_URL, else the embedded Redis of the default data folder)",
    )
    parser.add_argument("--namespace", default=None, help="key prefix (default: $PAGEDQ_NAMESPACE or pagedq)")
    parser.add_argument("--queue", default=None, help=queue_help or "queue name (default: $PAGEDQ_QUEUE or default)")


def settings_from_args(args: argparse.Namespace, **extra: Any) -> Settings:
    """The shared settings model, from the environment overridden by the flags that were given."""
    return load_settings(
        redis_url=getattr(args, "redis_url", None),
        namespace=getattr(args, "namespace", None),
        queue=getattr(args, "queue", None),
        **extra,
    )


def resolve_redis_url(settings: Settings) -> str:
    """``settings.redis_url``, else the unix socket of the embedded Redis that ``pagedq worker`` starts in
    ``data_dir`` when it has no URL (so a producer on the same machine needs no flag).

    Raises ``SettingsError`` when neither is available: guessing ``localhost:6379`` would silently talk
    to an unrelated Redis.
    """
    if settings.redis_url:
        return settings.redis_url
    from worker.embedded_redis import EmbeddedRedis

    embedded = EmbeddedRedis(settings.data_dir)
    if embedded.socket_path.exists():
        return embedded.url
    raise SettingsError(
        f"no Redis: pass --redis-url or set PAGEDQ_REDIS_URL (no embedded Redis socket at {embedded.socket_path})"
    )


REDIS_ERRORS = (redis.RedisError, RedisClusterException)
"""What a Redis that cannot be used raises. A cluster client's "no node answers" (at creation, which
connects at once, or later) is a ``RedisClusterException``, which is not a ``RedisError``: caught with the
rest, so an unreachable ``redis+cluster://`` URL is one line and exit 1, as an unreachable server is."""


def connect(url: str, **kwargs: Any) -> redis.Redis:
    """A str-decoding client; invalid UTF-8 in payloads survives (``surrogateescape``) so dead letters can be
    replayed byte for byte."""
    return redis_url.connect(
        url, decode_responses=True, encoding_errors="surrogateescape", socket_connect_timeout=5, **kwargs
    )


def _fail(prog: str, message: str, code: int = 1) -> int:
    print(f"pagedq {prog}: {message}", file=sys.stderr)
    return code


def live_worker_names(r: redis.Redis, keys: Keys) -> set[str]:
    """Names of the workers of ``keys.queue`` whose heartbeat has not expired (its TTL is 3 beats), from the
    namespace's index of workers (:mod:`worker.registry`), not a SCAN of the whole keyspace."""
    return {member.partition(":")[2] for member in live_heartbeats(r, keys.namespace, keys.queue)}


def _ago(ms: float | None) -> str:
    if ms is None:
        return "-"
    s = ms / 1000.0
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.1f}h"


def _table(rows: list[list[str]], indent: str = "    ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


# ------------------------------------------------------------------------------------------ submit


DEFAULT_WAIT_S = 600.0
"""How long ``submit`` waits for its result unless told otherwise: long enough for a busy queue, short
enough that a first try against a queue nobody serves ends (exit 124) instead of hanging."""


def add_submit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Queue one job and stream its tokens to the terminal as workers produce them "
        "(--json: print only the final event)."
    )
    parser.add_argument("prompt", help="the prompt (or, with --chat, the user message)")
    parser.add_argument("--chat", action="store_true", help="send as a chat user message (chat template applied)")
    parser.add_argument("--system", default=None, help="system message (implies --chat)")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens to generate at most (default 16)")
    parser.add_argument("--temperature", type=float, default=None, help="0 is greedy (default 1.0)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--n", type=int, default=None, help="number of choices (only choice 0 is streamed)")
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        # Not "higher is served first": workers read the stream first in, first out (worker/intake.py) and
        # priority only orders the jobs one worker already holds (engine/scheduler.py, worker/held_jobs.py).
        help="order among the jobs one worker holds (its running and waiting jobs, at most max_num_seqs + "
        "prefetch): higher gets the next free slot and the step's token budget first, and is preempted last. "
        "It does not overtake a backlog: workers read the stream first in, first out, so a job queued behind "
        "others is read after them and overtakes only those its worker still holds unstarted. For strict "
        "priority use a separate --queue with workers of its own (default 0)",
    )
    parser.add_argument("--timeout-s", type=float, default=None, help="job deadline, enforced by the worker")
    parser.add_argument("--id", default=None, help="job id (idempotency key; default: a fresh UUID)")
    parser.add_argument(
        "--wait-s",
        type=seconds,
        default=DEFAULT_WAIT_S,
        help=f"give up waiting after this long: exit 124, the job stays queued (default {DEFAULT_WAIT_S:g}; 0: never)",
    )
    parser.add_argument("--json", action="store_true", help="print the final event as JSON instead of streaming")
    add_connection_arguments(parser)


def _submit_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if args.chat or args.system is not None:
        messages = [{"role": "system", "content": args.system}] if args.system is not None else []
        fields["messages"] = [*messages, {"role": "user", "content": args.prompt}]
    else:
        fields["prompt"] = args.prompt
    for name in (
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "n",
        "priority",
        "timeout_s",
        "id",
    ):
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    # Streaming is what this command is for; with --json nobody reads token events, so none are sent.
    fields["stream"] = not args.json
    return fields


def run_submit(args: argparse.Namespace) -> int:
    from worker.client import JobFailed, PagedqClient, Restart, new_job_id

    try:
        settings = settings_from_args(args)
        url = resolve_redis_url(settings)
    except SettingsError as exc:
        return _fail("submit", str(exc), 2)
    try:
        client = PagedqClient(
            connect(url), namespace=settings.namespace, queue=settings.queue, queue_shards=settings.queue_shards
        )
    except REDIS_ERRORS as exc:  # a cluster client connects as it is made
        return _fail("submit", f"cannot reach Redis at {mask_url(url)}: {exc}")
    job_id = args.id or new_job_id()  # known before the XADD, so Ctrl-C at any point can cancel it

    def on_sigint(signum: int, frame: object) -> None:
        # Ctrl-C can land anywhere, also inside redis-py while it holds its connection pool's lock,
        # where unwinding a KeyboardInterrupt and closing the client can deadlock (seen under load in
        # CI): cancel through a client of its own, then leave at once.
        try:
            PagedqClient(
                connect(url), namespace=settings.namespace, queue=settings.queue, queue_shards=settings.queue_shards
            ).cancel(job_id)
            print(f"\npagedq submit: cancelled job {job_id}", file=sys.stderr)
            code = 130
        except REDIS_ERRORS as exc:
            print(f"\npagedq submit: could not cancel job {job_id}: {exc}", file=sys.stderr)
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        try:
            client.submit(**{**_submit_fields(args), "id": job_id})
        except ValidationError as exc:
            return _fail("submit", describe_validation_error(exc), 2)
        except REDIS_ERRORS as exc:
            return _fail("submit", f"cannot reach Redis at {mask_url(url)}: {exc}")
        wait_s = args.wait_s or None  # 0: no limit
        keys = Keys(settings.namespace, settings.queue, settings.queue_shards)
        try:
            if not live_worker_names(client.redis, keys):
                limit = f"giving up after {wait_s:g} s (--wait-s)" if wait_s else "waiting with no limit"
                print(
                    f"pagedq submit: warning: no live worker on queue {settings.queue!r} (no heartbeat under "
                    f"{keys.heartbeat_pattern}); job {job_id} waits until one starts (`pagedq worker`), {limit}",
                    file=sys.stderr,
                    flush=True,
                )
        except REDIS_ERRORS:
            pass  # only a hint: waiting for the result reports a Redis that went away
        out = sys.stdout
        try:
            if args.json:
                final: FinalEvent = client.result(job_id, timeout=wait_s)
                out.write(final.to_json() + "\n")
                out.flush()
                return 0
            wrote_text = False
            ends_newline = True
            for item in client.stream(job_id, timeout=wait_s):
                if isinstance(item, str):
                    out.write(item)
                    out.flush()  # the point of this command: every delta shows up as it arrives
                    wrote_text = wrote_text or bool(item)
                    ends_newline = item.endswith("\n") if item else ends_newline
                elif isinstance(item, Restart):
                    out.write("\n")
                    print(f"[worker lost; attempt {item.attempt} started the text again]", file=sys.stderr)
                else:
                    if wrote_text and not ends_newline:
                        out.write("\n")
                    out.flush()
                    _print_summary(item)
            return 0
        except JobFailed as exc:
            if args.json:
                out.write(exc.event.to_json() + "\n")
                out.flush()
            return _fail("submit", f"job {job_id} failed ({exc.code}): {exc.event.message}")
        except TimeoutError:
            return _fail("submit", f"no result for job {job_id} within {wait_s:g} s (it stays queued)", 124)
        except REDIS_ERRORS as exc:
            return _fail("submit", f"lost Redis while waiting for job {job_id}: {exc}")
    finally:
        signal.signal(signal.SIGINT, previous)
        client.close()


def add_cancel_arguments(parser: argparse.ArgumentParser) -> None:
    add_connection_arguments(parser)
    parser.add_argument("job_ids", nargs="+", metavar="JOB_ID", help="ids of the jobs to cancel")


def run_cancel(args: argparse.Namespace) -> int:
    """Cancel jobs by id, as :meth:`worker.client.PagedqClient.cancel` does (the v2 flag, then the notice): a
    queued job ends with error ``cancelled`` when a worker reads it, a running one with its partial text. A
    job that already ended is left as it is; the flag expires with its TTL either way."""
    from worker.client import PagedqClient

    try:
        settings = settings_from_args(args)
        url = resolve_redis_url(settings)
    except SettingsError as exc:
        return _fail("cancel", str(exc), 2)
    bad = [job_id for job_id in args.job_ids if not re.fullmatch(JOB_ID_PATTERN, job_id)]
    if bad:
        return _fail("cancel", f"not a job id: {', '.join(map(repr, bad))} (1-128 of A-Z a-z 0-9 . _ : -)", 2)
    try:
        client = PagedqClient(connect(url), namespace=settings.namespace, queue=settings.queue)
        for job_id in args.job_ids:
            client.cancel(job_id)
            print(f"cancelled {job_id}")
    except REDIS_ERRORS as exc:
        return _fail("cancel", f"Redis at {mask_url(url)} failed: {exc}")
    return 0


def _print_summary(final: FinalEvent) -> None:
    choice = final.choices[0] if final.choices else None
    t = final.timings
    parts = [
        f"job {final.id}",
        f"finish_reason={choice.finish_reason}" if choice else "no choices",
        f"{final.usage.prompt_tokens} prompt + {final.usage.completion_tokens} completion tokens",
        f"ttft {t.ttft_s:.3f}s" if t.ttft_s is not None else "no tokens",
        f"total {t.total_s:.3f}s",
        f"worker {final.worker}",
    ]
    print("[" + ", ".join(parts) + "]", file=sys.stderr)


# ------------------------------------------------------------------------------------------ status


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Per queue: backlog (jobs stream length), pending (delivered, not yet acked), consumers with idle "
        "times, dead letters, and live workers from their heartbeats."
    )
    add_connection_arguments(parser, queue_help="only this queue (default: every queue of the namespace)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--prune",
        action="store_true",
        help="delete the consumers of exited workers (no heartbeat) that hold no pending job",
    )


def queue_names(r: redis.Redis, namespace: str) -> list[str]:
    """Queue names that have a jobs stream, a dead-letter stream or a live worker in the namespace."""
    found: set[str] = set()
    for kind in ("jobs", "dead"):
        prefix = f"{namespace}:{kind}:{{"
        for key in r.scan_iter(match=prefix + "*", count=1000):
            name, sep, shard = key[len(prefix) :].rpartition(":")  # <queue>:<k>}
            if sep and ":" not in name and shard.endswith("}") and shard[:-1].isdigit():
                found.add(name)
    found.update(member.partition(":")[0] for member in live_heartbeats(r, namespace))
    return sorted(found)


def existing_shards(r: redis.Redis, keys: Keys, kind: str) -> set[int]:
    """Shard numbers ``k`` of every ``<ns>:<kind>:{<queue>:<k>}`` key (``kind``: jobs or dead) that exists,
    whatever ``keys.shards`` says: a producer with more shards than the workers leaves jobs beyond them."""
    prefix = f"{keys.namespace}:{kind}:{{{keys.queue}:"
    found: set[int] = set()
    for key in r.scan_iter(match=prefix + "*}", count=1000):
        digits = key[len(prefix) : -1]
        # Exactly what Keys.jobs_shard writes (no sign, no leading zero): anything else is not a shard.
        if digits.isascii() and digits.isdigit() and digits == str(int(digits)):
            found.add(int(digits))
    return found


def wrong_type(r: redis.Redis, exc: redis.ResponseError, key: str, expected: str, role: str) -> dict[str, str] | None:
    """What ``status`` reports of ``key`` when Redis refused a read of it with WRONGTYPE: the key holds another
    type than the ``expected`` one pagedq keeps there (a producer or an operator ``SET`` a string where a jobs
    stream lives, say). None for any other error, which the caller re-raises.

    Anyone who may write the namespace can do this, and the other keys are unaffected by it, so ``status``
    names the key, the type it holds and the one pagedq expects, and goes on with the rest instead of ending
    on Redis's one-line error with nothing else shown. The key is only read (``TYPE``): its value is left
    for the operator to inspect.
    """
    if not str(exc).startswith("WRONGTYPE"):
        return None
    try:
        found = str(r.type(key))
    except redis.RedisError:  # TYPE refused (an ACL) or the connection lost: the rest of the report goes on
        found = "unknown"
    return {"key": key, "type": found, "expected": expected, "role": role}


_WRONG_TYPE_EFFECT = {
    "jobs": "it is left out of the backlog, and Redis refuses workers' and producers' stream commands on it "
    "the same way",
    "dead-letter": "it is left out of the dead letters, and Redis refuses `pagedq dead list` on it the same way",
    "heartbeat": "it is not listed among the workers, yet a key under that name still counts as a live worker "
    "for `--prune` and for submit's no-worker check; a running worker of that name replaces it with its next "
    "heartbeat",
}


def wrong_type_warning(found: dict[str, str]) -> str:
    """A wrong-type key (:func:`wrong_type`) in plain words, with what it hides and what to do."""
    kind = found["role"].split(" ", 1)[0]
    return (
        f"{found['key']} is a {found['type']}, where pagedq keeps a {found['expected']} ({found['role']}): "
        f"{_WRONG_TYPE_EFFECT[kind]}. Inspect it, then RENAME it away (its value is kept) or DEL it; the rest "
        "of this report is complete."
    )


def queue_status(r: redis.Redis, keys: Keys) -> dict[str, Any]:
    """One queue's numbers, straight from Redis (works whether or not any worker is alive).

    Counts every shard stream that exists, not only the ``keys.shards`` this command was configured with:
    jobs on a shard at or above the workers' ``queue_shards`` are never read, and hiding them would hide
    the misconfiguration. ``shard_streams`` has each shard's numbers, ``unserved`` sums the shards at or
    above ``keys.shards``, and ``warnings`` says in words what looks wrong and how to fix it.

    A key of the queue holding another type than pagedq keeps there is listed in ``wrong_type_keys``
    (:func:`wrong_type`), with a warning, and left out of the numbers; its shard row's ``wrong_type`` has
    the type each such stream of it holds (``{"stream": "string"}``).
    """
    now_ms = time.time() * 1000
    job_shards = existing_shards(r, keys, "jobs")
    dead_shards = existing_shards(r, keys, "dead")
    counted = sorted(set(range(keys.shards)) | job_shards)
    status: dict[str, Any] = {
        "queue": keys.queue,
        "stream": keys.jobs,
        "streams": [keys.jobs_shard(k) for k in counted],
        "backlog": 0,
        "pending": 0,
        "lag": None,
        "consumers": [],
        "dead_letters": 0,
        "workers": [],
    }
    shards: dict[int, dict[str, Any]] = {
        k: {
            "shard": k,
            "stream": keys.jobs_shard(k),
            "dead_stream": keys.dead_shard(k),
            "served": k < keys.shards,
            "backlog": 0,
            "pending": 0,
            "dead_letters": 0,
            "group": False,
            "consumers": [],
        }
        for k in sorted(job_shards | dead_shards)
    }
    consumers: dict[str, dict[str, Any]] = {}
    wrong: list[dict[str, str]] = []
    for k in sorted(job_shards):
        stream, row = keys.jobs_shard(k), shards[k]
        try:
            row["backlog"] = int(r.xlen(stream))
        except redis.ResponseError as exc:
            if (found := wrong_type(r, exc, stream, "stream", f"jobs stream of shard {k}")) is None:
                raise
            wrong.append(found)
            row.setdefault("wrong_type", {})["stream"] = found["type"]
            continue
        status["backlog"] += row["backlog"]
        try:
            row["pending"] = int(r.xpending(stream, GROUP)["pending"])
            status["pending"] += row["pending"]
            groups = {g["name"]: g for g in r.xinfo_groups(stream)}
            row["group"] = GROUP in groups
            lag = groups.get(GROUP, {}).get("lag")  # Redis >= 7: entries never delivered to the group
            if lag is not None:
                status["lag"] = (status["lag"] or 0) + int(lag)
            for c in r.xinfo_consumers(stream, GROUP):
                row["consumers"].append(c["name"])
                inactive = None if c.get("inactive") in (None, -1) else int(c["inactive"])
                seen = consumers.get(c["name"])
                if seen is None:
                    consumers[c["name"]] = {
                        "name": c["name"],
                        "pending": int(c["pending"]),
                        "idle_ms": int(c["idle"]),
                        "inactive_ms": inactive,
                    }
                else:  # the same worker on another shard: its totals, and its freshest times
                    seen["pending"] += int(c["pending"])
                    seen["idle_ms"] = min(seen["idle_ms"], int(c["idle"]))
                    if inactive is not None:
                        seen["inactive_ms"] = min(inactive, seen["inactive_ms"] or inactive)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):  # no worker ever joined: everything is backlog
                raise
    for k in sorted(dead_shards):
        try:
            shards[k]["dead_letters"] = int(r.xlen(keys.dead_shard(k)))
        except redis.ResponseError as exc:
            if (found := wrong_type(r, exc, keys.dead_shard(k), "stream", f"dead-letter stream of shard {k}")) is None:
                raise
            wrong.append(found)
            shards[k].setdefault("wrong_type", {})["dead_stream"] = found["type"]
            continue
        status["dead_letters"] += shards[k]["dead_letters"]
    status["consumers"] = list(consumers.values())
    status["shards"] = keys.shards
    status["shard_streams"] = list(shards.values())
    workers: list[dict[str, Any]] = []
    for key in heartbeat_keys(keys.namespace, index_members(r, keys.namespace), keys.queue):
        name = key.rsplit(":", 1)[-1]
        try:
            raw = r.get(key)
        except redis.ResponseError as exc:
            if (found := wrong_type(r, exc, key, "string", f"heartbeat of worker {name}")) is None:
                raise
            wrong.append(found)
            continue
        if raw is None:
            continue  # expired since the index listed it
        try:
            beat = json.loads(raw)
        except ValueError:
            beat = {}
        if not isinstance(beat, dict):  # valid JSON, but no heartbeat a worker writes
            beat = {}
        ts = beat.get("ts")
        workers.append(
            {
                "name": name,
                **{
                    k: beat.get(k)
                    for k in (
                        "state",
                        "model",
                        "running",
                        "waiting",
                        "unstarted",
                        "in_flight",
                        "kv_cache_usage",
                        "jobs_final",
                        "jobs_error",
                    )
                },
                "last_seen_ms": None if not isinstance(ts, (int, float)) else max(0.0, now_ms - ts * 1000),
            }
        )
    status["workers"] = workers
    live = {w["name"] for w in workers}
    for consumer in status["consumers"]:
        # A consumer outlives its worker in the group; only the heartbeat says whether one is still there.
        consumer["live"] = consumer["name"] in live
    status["unserved"], status["warnings"] = _shard_findings(keys, status["shard_streams"], live)
    status["wrong_type_keys"] = wrong
    status["warnings"] += [wrong_type_warning(found) for found in wrong]
    return status


def _shard_list(shards: Sequence[int]) -> str:
    """``1-3, 5``: shard numbers as an operator would write them."""
    runs: list[list[int]] = []
    for k in sorted(shards):
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def jobs_streams_label(keys: Keys, shards: Sequence[int]) -> str:
    """Job streams for a line of text: ``ns:jobs:{q:0..3}`` for consecutive shards from 0, else each named."""
    if len(shards) > 1 and list(shards) == list(range(len(shards))):
        return f"{keys.namespace}:jobs:{{{keys.queue}:0..{len(shards) - 1}}}"
    return ", ".join(keys.jobs_shard(k) for k in shards)


def _shard_findings(
    keys: Keys, shard_streams: list[dict[str, Any]], live: set[str]
) -> tuple[dict[str, Any] | None, list[str]]:
    """What ``status`` says about the shards: the summary of those at or above ``keys.shards`` (None when
    there are none), and warnings in plain words, each with what to do.

    Producers and workers must agree on ``queue_shards`` (README, "Wire protocol v2"): a worker reads shards
    0 to ``queue_shards - 1`` only, so a job a producer with more shards put beyond them waits forever. Which
    side is wrong cannot be read from Redis, so the words give the fix for each case: no live worker reads
    those shards (start workers with more shards), or live ones do (this command has too few).
    """
    n = keys.shards
    warnings: list[str] = []
    beyond = [row for row in shard_streams if not row["served"]]
    unserved: dict[str, Any] | None = None
    if beyond:
        readers = sorted({c for row in beyond for c in row["consumers"] if c in live})
        unserved = {
            "shards": [row["shard"] for row in beyond],
            "streams": [row["stream"] for row in beyond],
            "backlog": sum(row["backlog"] for row in beyond),
            "dead_letters": sum(row["dead_letters"] for row in beyond),
            "live_readers": readers,
            "queue_shards_needed": beyond[-1]["shard"] + 1,
        }
        stranded = [row for row in beyond if row["backlog"]]
        if stranded:
            needed = stranded[-1]["shard"] + 1
            counts = ", ".join(f"{row['stream']}: {row['backlog']}" for row in stranded)
            text = (
                f"{unserved['backlog']} job(s) on shard(s) {_shard_list([row['shard'] for row in stranded])} "
                f"({counts}) are not served by workers with queue_shards={n}: a worker reads shards 0 to "
                f"queue_shards-1 only, and a producer with queue_shards={needed} or more put these there. "
            )
            if readers:
                text += (
                    f"Live worker(s) {', '.join(readers)} do read these shards, so the workers run with more "
                    f"shards than this command: run it with PAGEDQ_QUEUE_SHARDS set as theirs."
                )
            else:
                text += (
                    f"No live worker reads them. To serve them, run the workers with queue_shards={needed} or "
                    f"more (PAGEDQ_QUEUE_SHARDS={needed}); producers and workers must use the same queue_shards."
                )
            warnings.append(text)
        dead = [row for row in beyond if row["dead_letters"]]
        if dead:
            warnings.append(
                f"{unserved['dead_letters']} dead letter(s) in {', '.join(row['dead_stream'] for row in dead)} "
                f"are not shown by `pagedq dead list` with queue_shards={n}: run it with "
                f"PAGEDQ_QUEUE_SHARDS={dead[-1]['shard'] + 1}."
            )
    # The other way round: this command counts shards the workers do not read. Workers create the `workers`
    # group on every shard they read when they start, so a shard holding jobs without it, next to one with
    # it, has never been looked at by any of them.
    grouped = [row["shard"] for row in shard_streams if row["group"]]
    never = [row for row in shard_streams if row["served"] and row["backlog"] and not row["group"]]
    if grouped and never:
        counts = ", ".join(f"{row['stream']}: {row['backlog']}" for row in never)
        warnings.append(
            f"{sum(row['backlog'] for row in never)} job(s) on shard(s) "
            f"{_shard_list([row['shard'] for row in never])} ({counts}) have never been read by any worker: no "
            f"`{GROUP}` consumer group there, while shard(s) {_shard_list(grouped)} have one (a worker creates it "
            f"on every shard it reads when it starts). The workers probably run with queue_shards below {n}, "
            f"this command's setting: producers and workers must use the same queue_shards."
        )
    return unserved, warnings


_PRUNE = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return -1 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
"""
"""Delete consumer ARGV[2] only if it holds no pending entry, in one step: DELCONSUMER drops a consumer's
pending entries with it, and an entry in no one's pending list is never delivered or reclaimed again."""


def prune_consumers(r: redis.Redis, keys: Keys) -> list[str]:
    """Delete the consumers of ``keys.queue`` that have no live worker behind them and nothing pending.

    Safe against a race with a worker: the pending check and the delete are one script, and a live
    worker that lost its consumer this way (its heartbeat late) gets it back on its next read.
    """
    live = live_worker_names(r, keys)
    pruned: list[str] = []
    for stream in keys.job_streams:
        if not r.exists(stream):
            continue
        try:
            consumers: Any = r.xinfo_consumers(stream, GROUP)
        except redis.ResponseError as exc:
            # No group: no consumer to prune. WRONGTYPE: no stream, no consumer; status's report names the key.
            if "NOGROUP" in str(exc) or str(exc).startswith("WRONGTYPE"):
                continue
            raise
        for c in consumers:
            if c["name"] in live or int(c["pending"]):
                continue
            if int(r.eval(_PRUNE, 1, stream, GROUP, c["name"])) >= 0 and c["name"] not in pruned:
                pruned.append(c["name"])
    return pruned


def run_status(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        url = resolve_redis_url(settings)
    except SettingsError as exc:
        return _fail("status", str(exc), 2)
    try:
        r = connect(url)
    except REDIS_ERRORS as exc:  # a cluster client connects as it is made
        return _fail("status", f"cannot read from Redis at {mask_url(url)}: {exc}")
    try:
        queues = [args.queue] if args.queue else queue_names(r, settings.namespace)
        if args.prune:
            for q in queues:
                pruned = prune_consumers(r, Keys(settings.namespace, q, settings.queue_shards))
                if pruned:
                    print(f"queue {q}: deleted {len(pruned)} consumer(s): {', '.join(pruned)}", file=sys.stderr)
        statuses = [queue_status(r, Keys(settings.namespace, q, settings.queue_shards)) for q in queues]
    except REDIS_ERRORS as exc:
        return _fail("status", f"cannot read from Redis at {mask_url(url)}: {exc}")
    finally:
        r.close()
    if args.json:
        print(json.dumps({"namespace": settings.namespace, "queues": statuses}, indent=2))
        return 0
    if not statuses:
        print(f"namespace {settings.namespace}: no queues, no workers")
        return 0
    for st in statuses:
        print("\n".join(_format_status(settings.namespace, st)))
    return 0


def _format_status(namespace: str, st: dict[str, Any]) -> list[str]:
    lag = "" if st["lag"] is None else f", {st['lag']} not yet delivered"
    keys = Keys(namespace, st["queue"])
    streams = jobs_streams_label(keys, [keys.shard_of_stream(stream) for stream in st["streams"]])
    lines = [
        f"queue {st['queue']} ({namespace})",
        f"  backlog       {st['backlog']} job(s) in {streams} ({st['pending']} pending in workers{lag})",
    ]
    for warning in st["warnings"]:
        # Right under the backlog they are about; stream names are never broken across lines.
        lines += textwrap.wrap(
            warning,
            width=110,
            initial_indent="  warning       ",
            subsequent_indent=" " * 16,
            break_long_words=False,
            break_on_hyphens=False,
        )
    lines.append(f"  dead letters  {st['dead_letters']}")
    if st["consumers"]:
        lines.append(f"  consumers     {len(st['consumers'])}")
        rows = [["NAME", "WORKER", "PENDING", "IDLE", "INACTIVE"]]
        rows += [
            [
                c["name"],
                "live" if c["live"] else "gone",
                str(c["pending"]),
                _ago(c["idle_ms"]),
                _ago(c["inactive_ms"]),
            ]
            for c in st["consumers"]
        ]
        lines += _table(rows)
        gone = [c for c in st["consumers"] if not c["live"]]
        if gone:
            held = sum(c["pending"] for c in gone)
            lines.append(
                f"    {len(gone)} consumer(s) without a heartbeat: their workers exited (or hung)"
                + (f"; a live worker takes over their {held} pending job(s) after reclaim_idle_s" if held else "")
                + "; `pagedq status --prune` deletes those holding nothing"
            )
    else:
        lines.append("  consumers     none")
    if st["workers"]:
        lines.append(f"  live workers  {len(st['workers'])}")
        rows = [["NAME", "STATE", "RUNNING", "WAITING", "IN FLIGHT", "KV USED", "DONE", "FAILED", "LAST SEEN"]]
        for w in st["workers"]:
            kv = w.get("kv_cache_usage")
            rows.append(
                [
                    w["name"],
                    str(w.get("state") or "?"),
                    str(w.get("running", "?")),
                    str(w.get("waiting", "?")),
                    str(w.get("in_flight", "?")),
                    f"{kv:.0%}" if isinstance(kv, (int, float)) else "?",
                    str(w.get("jobs_final", "?")),
                    str(w.get("jobs_error", "?")),
                    _ago(w["last_seen_ms"]) + " ago",
                ]
            )
        lines += _table(rows)
    else:
        lines.append("  live workers  none")
    return lines


# ------------------------------------------------------------------------------------------- dead


def add_dead_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Dead letters of a queue: invalid jobs and jobs out of attempts."
    sub = parser.add_subparsers(dest="dead_command", required=True, metavar="{list,replay}")
    p = sub.add_parser(
        "list", help="show dead letters, oldest first", description="Show the dead letters of a queue, oldest first."
    )
    add_connection_arguments(p)
    p.add_argument(
        "--count", type=int_at_least(0, "all"), default=20, help="show at most this many (default 20; 0: all)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per dead letter, with the raw job")
    p = sub.add_parser(
        "replay",
        help="re-queue dead letters",
        description="Re-queue dead letters as new jobs: their stored error result and reply stream are "
        "deleted first (otherwise the job id's result would make workers skip them), then "
        "the raw job is added to the jobs stream and the dead letter removed (--keep keeps it).",
    )
    add_connection_arguments(p)
    p.add_argument("entries", nargs="*", help="dead-letter entry ids (as `dead list` shows them)")
    p.add_argument("--all", action="store_true", help="replay every dead letter of the queue")
    p.add_argument("--keep", action="store_true", help="keep the dead letters after re-queueing")


def run_dead(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        url = resolve_redis_url(settings)
    except SettingsError as exc:
        return _fail("dead", str(exc), 2)
    keys = Keys(settings.namespace, settings.queue, settings.queue_shards)
    try:
        r = connect(url)
    except REDIS_ERRORS as exc:  # a cluster client connects as it is made
        return _fail("dead", f"Redis error at {mask_url(url)}: {exc}")
    try:
        if args.dead_command == "list":
            return _dead_list(r, keys, args)
        return _dead_replay(r, keys, args)
    except REDIS_ERRORS as exc:
        return _fail("dead", f"Redis error at {mask_url(url)}: {exc}")
    finally:
        r.close()


class MalformedDeadLetter(ValueError):
    """A dead-letter entry whose fields do not make a :class:`DeadLetter`: written by something other than a
    pagedq worker (anyone who may ``XADD`` can), or edited by hand.

    Why a value of its own rather than pydantic's error: one such entry ended ``dead list`` and ``dead replay
    --all`` in a traceback, hiding every good letter behind it. Named by its ref, with what is wrong and its
    raw fields, it is shown as what it is, and left where it is (nothing of it is lost or replayed)."""

    def __init__(self, ref: str, fields: dict[str, str], problem: str) -> None:
        super().__init__(f"dead letter {ref} is malformed ({problem})")
        self.ref = ref
        self.fields = fields
        self.problem = problem


Letter = DeadLetter | MalformedDeadLetter
"""One entry of a dead-letter stream as read: a dead letter, or the reason it is not one."""


def read_dead_letter(ref: str, fields: dict[str, str]) -> DeadLetter:
    """``fields`` of the dead-letter entry ``ref`` as a :class:`DeadLetter`; :class:`MalformedDeadLetter`
    when they are not one."""
    try:
        return DeadLetter.from_fields(fields)
    except ValidationError as exc:
        raise MalformedDeadLetter(ref, dict(fields), describe_validation_error(exc)) from None


def _read_letter(ref: str, fields: dict[str, str]) -> Letter:
    try:
        return read_dead_letter(ref, fields)
    except MalformedDeadLetter as exc:
        return exc


def _letters(r: redis.Redis, keys: Keys, count: int | None) -> list[tuple[str, Letter]]:
    """Entries of every dead-letter shard, shard 0 first, each named by its ref (``<entry id>@<k>`` on shard
    k): a :class:`DeadLetter`, or a :class:`MalformedDeadLetter` for an entry that is not one."""
    out: list[tuple[str, Letter]] = []
    for shard, dead in enumerate(keys.dead_streams):
        left = None if count is None else count - len(out)
        if left is not None and left <= 0:
            break
        entries: Any = r.xrange(dead, count=left)
        for entry_id, fields in entries:
            ref = entry_ref(shard, entry_id)
            out.append((ref, _read_letter(ref, fields)))
    return out


def find_dead_letter(r: redis.Redis, keys: Keys, ref: str) -> DeadLetter | None:
    """The dead letter a ref names (as ``dead list`` shows it), or None; :class:`MalformedDeadLetter` (a
    ``ValueError``) when that entry is not a dead letter."""
    shard, entry_id = split_entry_ref(ref)
    if shard >= keys.shards:
        return None
    found: Any = r.xrange(keys.dead_shard(shard), min=entry_id, max=entry_id)
    return read_dead_letter(ref, found[0][1]) if found else None


def dead_streams_label(keys: Keys) -> str:
    return keys.dead if keys.shards == 1 else f"{keys.namespace}:dead:{{{keys.queue}:0..{keys.shards - 1}}}"


def _valid_text(value: str, errors: str) -> str:
    """A string read with ``surrogateescape`` as valid Unicode: each byte that was not UTF-8 becomes U+FFFD
    (``errors="replace"``) or ``\\xNN`` (``"backslashreplace"``). Printed as is, such a byte goes out raw
    (or, with a strict stdout, raises), and nothing downstream can read the line as UTF-8."""
    return value.encode("utf-8", "surrogateescape").decode("utf-8", errors)


def dead_letter_json(entry_id: str, d: DeadLetter) -> dict[str, Any]:
    """One dead letter as a JSON-ready object: every string valid Unicode, and ``job_base64`` the payload's
    exact bytes when ``job`` cannot hold them (null otherwise).

    Why base64 and not the escaped bytes: a lone surrogate escape (``"\\udcc3"``) is valid JSON grammar but
    not a character, and strict readers (Rust's serde_json, Go's encoding/json turns it into U+FFFD) refuse
    or alter it, so the bytes would not survive a round trip; base64 does in every language, and ``job``
    stays readable text (U+FFFD where a byte was invalid) for people and ``jq``.
    """
    row: dict[str, Any] = {"entry": _valid_text(entry_id, "replace")}
    for name, value in d.model_dump().items():
        row[name] = _valid_text(value, "replace") if isinstance(value, str) else value
    raw = d.job.encode("utf-8", "surrogateescape")
    row["job_base64"] = None if row["job"] == d.job else base64.b64encode(raw).decode("ascii")
    return row


def malformed_letter_json(bad: MalformedDeadLetter) -> dict[str, Any]:
    """A malformed dead-letter entry as a JSON-ready object: its ref, what is wrong, and its raw fields (valid
    Unicode, as in :func:`dead_letter_json`), so a reader can tell it from a dead letter by ``malformed``."""
    fields = {_valid_text(k, "replace"): _valid_text(v, "replace") for k, v in bad.fields.items()}
    return {"entry": _valid_text(bad.ref, "replace"), "malformed": bad.problem, "fields": fields}


def _dead_list(r: redis.Redis, keys: Keys, args: argparse.Namespace) -> int:
    total = sum(int(r.xlen(dead)) for dead in keys.dead_streams)
    letters = _letters(r, keys, args.count or None)
    if args.json:
        for entry_id, d in letters:
            row = malformed_letter_json(d) if isinstance(d, MalformedDeadLetter) else dead_letter_json(entry_id, d)
            # ASCII (\u escapes) whatever the terminal's locale: every line is UTF-8 and JSON anywhere.
            print(json.dumps(row))
        return 0
    shown = f" (showing the first {len(letters)})" if len(letters) < total else ""
    print(f"{total} dead letter(s) in {dead_streams_label(keys)}{shown}")
    if not letters:
        return 0
    rows = [["ENTRY", "TIME (UTC)", "JOB ID", "CODE", "ATTEMPTS", "REASON"]]
    for entry_id, d in letters:
        if isinstance(d, MalformedDeadLetter):
            job_id = d.fields.get("job_id") or "-"
            cells = [entry_id, "-", job_id, "malformed", "-"]
            rows.append([*(_valid_text(c, "backslashreplace") for c in cells), _short(d.problem)])
            continue
        when = datetime.fromtimestamp(d.ts_ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")
        # Anyone can write a dead-letter stream: show its bytes that are not UTF-8 as \xNN, never raw.
        reason = _short(_valid_text(d.reason, "backslashreplace"))
        cells = [entry_id, when, d.job_id or "-", d.code, str(d.attempts)]
        rows.append([*(_valid_text(c, "backslashreplace") for c in cells), reason])
    print("\n".join(_table(rows, indent="")))
    return 0


def _short(text: str, width: int = 70) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _owned_by(r: redis.Redis, stream: str, entry_id: str) -> bool:
    """Whether ``stream`` is a reply stream a worker created for job entry ``entry_id``."""
    if not entry_id or r.type(stream) not in ("stream", b"stream"):
        return False
    first: Any = r.xrange(stream, count=1)
    return bool(first) and first[0][1].get(OWNER_FIELD) == entry_id


def replayed_payloads(d: DeadLetter) -> list[str]:
    """What a replay of ``d`` queues, one entry each: its job, or, for an entry that carried several ``job``
    fields (dead-lettered whole as a JSON list of ``[field, value]`` pairs, worker/intake.py
    ``Intake._several_jobs``), each of those jobs: the split its producer should have sent. A job itself is
    a JSON object, never such a list, so the two cannot be confused."""
    try:
        pairs = json.loads(d.job)
    except (ValueError, RecursionError):
        return [d.job]
    if isinstance(pairs, list) and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in pairs
    ):
        jobs = [value for name, value in pairs if name == JOB_FIELD]
        if len(jobs) > 1:
            return jobs
    return [d.job]


def replay_dead_letter(r: redis.Redis, keys: Keys, entry_id: str, d: DeadLetter, *, keep: bool = False) -> list[str]:
    """Re-queue one dead letter (not a truncated one: the caller checks) and return its new jobs-stream entry
    ids, one per job (:func:`replayed_payloads`).

    Shared by ``pagedq dead replay`` and the gateway's dashboard, so both clear the same keys the same way.
    ``entry_id`` is the dead letter's ref; the job goes back to the shard it came from. On a cluster the
    keys live in several slots, so the steps are not one transaction there: a replay cut short and run
    again may queue the job twice, which its id makes harmless (one terminal event per id).
    """
    shard, dead_id = split_entry_ref(entry_id)
    pipe = r.pipeline(transaction=not is_cluster_client(r))
    payloads = replayed_payloads(d)
    deletes = 0  # commands queued before the XADDs, whose replies come first
    for payload in payloads:
        target = salvage_reply_target(payload, 1 << 30)
        if target is not None:
            job_id, reply_to = target
            # The dead-lettered error is stored as the job's result: left there, workers would treat the
            # replay as a duplicate and skip it, and readers would see the old error in the reply stream.
            pipe.delete(keys.result(job_id), keys.reply(job_id))
            deletes += 1
            if reply_to is not None and _owned_by(r, reply_to, d.entry_id):
                pipe.delete(reply_to)  # the old attempt's stream: the replay (a new entry) could not write it
                deletes += 1
    for payload in payloads:
        pipe.xadd(keys.jobs_shard(shard), {JOB_FIELD: payload})
    if not keep:
        pipe.xdel(keys.dead_shard(shard), dead_id)
    replies = pipe.execute()
    return [str(entry) for entry in replies[deletes : deletes + len(payloads)]]


_DEAD_REF = re.compile(r"([0-9]+)-([0-9]+)(?:@([0-9]+))?")  # not \d: it matches any script's digits
"""A dead letter's name as ``dead list`` shows it: ``<ms>-<seq>``, with ``@<shard>`` on shards above 0."""


def bad_dead_ref(ref: str) -> str | None:
    """Why ``ref`` cannot name a dead letter (a usage error, said before anything is replayed), or None."""
    m = _DEAD_REF.fullmatch(ref)
    if m is None or max(int(m[1]), int(m[2])) >= 1 << 64:  # Redis stream ids are two unsigned 64-bit numbers
        return (
            f"bad entry id {ref!r}: expected <ms>-<seq> as `pagedq dead list` shows it, with @<shard> on "
            f"shards above 0 (e.g. 1712345678901-0 or 1712345678901-0@2)"
        )
    return None


def _dead_replay(r: redis.Redis, keys: Keys, args: argparse.Namespace) -> int:
    if bool(args.entries) == bool(args.all):
        return _fail("dead replay", "name dead-letter entry ids, or pass --all", 2)
    for entry_id in args.entries:
        # Before any lookup: Redis would answer a malformed id with a protocol error ("Redis error", exit 1),
        # and a bad shard suffix (`1-0@x`) would end in a traceback.
        bad = bad_dead_ref(entry_id)
        if bad is not None:
            return _fail("dead replay", bad, 2)
    if args.all:
        letters = _letters(r, keys, None)
    else:
        letters = []
        for entry_id in dict.fromkeys(args.entries):  # once each: a ref named twice would queue its job twice
            try:
                letter = find_dead_letter(r, keys, entry_id)
            except MalformedDeadLetter as exc:
                # Before anything is replayed, as for an id that names nothing: the command did not do
                # what it was asked, and the entry stays for the operator to fix or delete.
                return _fail("dead replay", f"{exc}: not replayed, nothing was (`pagedq dead list` shows it)", 1)
            if letter is None:
                shard = split_entry_ref(entry_id)[0]
                beyond = (
                    f" (shard {shard} is beyond queue_shards={keys.shards}: set PAGEDQ_QUEUE_SHARDS as the "
                    f"workers have it)"
                    if shard >= keys.shards
                    else ""
                )
                return _fail("dead replay", f"no dead letter {entry_id} in {dead_streams_label(keys)}{beyond}", 1)
            letters.append((entry_id, letter))
    replayed = malformed = 0
    for entry_id, d in letters:
        if isinstance(d, MalformedDeadLetter):
            print(f"warning: {d}; not replayed, left in place", file=sys.stderr)
            malformed += 1
            continue
        if d.truncated:
            print(
                f"warning: {entry_id} keeps only {len(d.job.encode('utf-8', 'surrogateescape'))} of the job's "
                f"{d.job_bytes} bytes (sha256 {d.job_sha256}); not replayed",
                file=sys.stderr,
            )
            continue
        if any(salvage_reply_target(payload, 1 << 30) is None for payload in replayed_payloads(d)):
            print(
                f"warning: {entry_id} has no valid job id; it will be dead-lettered again unless fixed", file=sys.stderr
            )
        new_ids = replay_dead_letter(r, keys, entry_id, d, keep=args.keep)
        stream = keys.jobs_shard(split_entry_ref(entry_id)[0])
        split = f" (its {len(new_ids)} jobs, one entry each)" if len(new_ids) > 1 else ""
        print(f"{entry_id} -> {stream} {', '.join(new_ids)}" + (f" (job {d.job_id})" if d.job_id else "") + split)
        replayed += 1
    print(f"replayed {replayed} dead letter(s)", file=sys.stderr)
    if malformed:
        # Non-zero, so a script running `dead replay --all` sees that the stream is not empty afterwards.
        return _fail("dead replay", f"{malformed} malformed dead letter(s) not replayed (left in place)", 1)
    return 0


# --------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser with the four commands (``ops/cli.py`` mounts the same functions)."""
    parser = argparse.ArgumentParser(prog="pagedq")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, add, run in (
        ("submit", add_submit_arguments, run_submit),
        ("status", add_status_arguments, run_status),
        ("dead", add_dead_arguments, run_dead),
        ("cancel", add_cancel_arguments, run_cancel),
    ):
        p = sub.add_parser(name)
        add(p)
        p.set_defaults(func=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, not at exit, so a closed pipe is caught below
    except BrokenPipeError:
        from worker.__main__ import stdout_gone

        return stdout_gone()
    return code


if __name__ == "__main__":
    sys.exit(main())
