"""How many token events per second one Redis node takes from N worker processes (README, "Scaling out").

Starts N ``python -m worker`` processes on the ``--quick`` tiny model against the Redis at ``--redis-url``,
queues jobs that stream ``--max-tokens`` tokens each (``ignore_eos``), and counts the token events the node
received (the ``XADD`` calls of ``INFO commandstats``, which include those made inside the publisher's
scripts) over the wall time from the first submission to the last result. Compare with ``redis-benchmark``
on the same node, e.g. ``redis-benchmark -p PORT -c 50 -n 200000 -q XADD s '*' event x``.

    python -m ops.bench.token_events --redis-url redis://127.0.0.1:6399/0 --workers 2 --jobs 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from ops.bench.tiny import make_quick_model
from worker.client import PagedqClient
from worker.redis_url import connect

WORKER_CMD = [sys.executable, "-m", "worker", "--dtype", "float32", "--device", "cpu", "--max-num-seqs", "16"]


def xadd_calls(client: Any) -> int:
    stats: Any = client.info("commandstats")
    return int(stats.get("cmdstat_xadd", {}).get("calls", 0))


def measure(url: str, workers: int, jobs: int, max_tokens: int, work: Path) -> dict[str, Any]:
    model = make_quick_model(work / "model")
    namespace = "tok" + uuid.uuid4().hex[:8]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PAGEDQ_LOG_LEVEL": "warning"}
    procs = [
        subprocess.Popen(
            [*WORKER_CMD, "--redis-url", url, "--namespace", namespace, "--name", f"w{i}", "--model", str(model)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(workers)
    ]
    client = PagedqClient(url, namespace=namespace)
    raw = connect(url, decode_responses=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(raw.scan_iter(client.keys.heartbeat_pattern))) < workers:
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not start")
            time.sleep(0.1)
        before = xadd_calls(raw)
        start = time.perf_counter()
        ids = client.submit_many(["tell me a story"] * jobs, max_tokens=max_tokens, ignore_eos=True, temperature=0)
        tokens = sum(len(client.result(job_id, timeout=600).choices[0].token_ids) for job_id in ids)
        elapsed = time.perf_counter() - start
        events = xadd_calls(raw) - before - jobs  # less the terminal events' XADDs (one per job)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        client.close()
    return {
        "workers": workers,
        "jobs": jobs,
        "tokens": tokens,
        "token_events": events,
        "elapsed_s": round(elapsed, 2),
        "token_events_per_s": round(events / elapsed),
        "tokens_per_s": round(tokens / elapsed),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        print(json.dumps(measure(args.redis_url, args.workers, args.jobs, args.max_tokens, Path(work))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
