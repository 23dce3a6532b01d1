"""The online workload's client: Poisson arrivals, streamed tokens stamped as they arrive, and the latency
statistics over them (TTFT, inter-token latency, TPOT, end to end, jobs per second)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ops.bench.workloads import BenchRequest


async def run_online_client(url: str, namespace: str, reqs: list[BenchRequest], timeout: float) -> list[dict[str, Any]]:
    from worker.client import AsyncPagedqClient

    client = AsyncPagedqClient(url, namespace=namespace, block_ms=200)
    start = time.perf_counter()

    async def one(r: BenchRequest) -> dict[str, Any]:
        await asyncio.sleep(max(0.0, start + r.arrival_s - time.perf_counter()))
        t_submit = time.perf_counter()
        job_id = await client.submit(
            r.prompt_ids, max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True, stream=True
        )
        stamps: list[float] = []
        tokens: list[int] = []
        final_tokens: list[int] | None = None
        cached = 0
        async for ev in client.events(job_id, timeout=timeout):
            if ev.type == "token":
                if ev.token_ids:
                    stamps.append(time.perf_counter())
                    tokens.extend(ev.token_ids)
            elif ev.type == "final":
                final_tokens = list(ev.choices[0].token_ids)
                cached = ev.usage.cached_tokens
            else:
                raise RuntimeError(f"online job failed: {ev.code}: {ev.message}")
        done = time.perf_counter()
        return {
            "submit": t_submit - start,
            "stamps": [s - start for s in stamps],
            "done": done - start,
            "tokens": final_tokens if final_tokens is not None else tokens,
            "streamed_tokens": len(tokens),
            "cached": cached,
        }

    try:
        return list(await asyncio.gather(*(one(r) for r in reqs)))
    finally:
        await client.close()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def latency_stats(records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """TTFT (submit -> first streamed token), ITL (gaps between token events), end-to-end, jobs/s."""
    ttft = [rec["stamps"][0] - rec["submit"] for rec in records if rec["stamps"]]
    itl = [b - a for rec in records for a, b in zip(rec["stamps"], rec["stamps"][1:], strict=False)]
    # Time per output token after the first (vLLM's TPOT): with speculative decoding one event can
    # carry several tokens, so the gap between events (ITL) is a step, not a token.
    tpot = [
        (rec["done"] - rec["stamps"][0]) / (rec["streamed_tokens"] - 1)
        for rec in records
        if rec["stamps"] and rec["streamed_tokens"] > 1
    ]
    e2e = [rec["done"] - rec["submit"] for rec in records]
    first = min((rec["submit"] for rec in records), default=0.0)
    last = max((rec["done"] for rec in records), default=0.0)
    span = max(last - first, 1e-9)
    ms = lambda v: round(1000 * v, 2)
    return {
        "ttft_ms": {"p50": ms(_pct(ttft, 50)), "p99": ms(_pct(ttft, 99)), "mean": ms(sum(ttft) / max(1, len(ttft)))},
        "itl_ms": {"p50": ms(_pct(itl, 50)), "p99": ms(_pct(itl, 99)), "mean": ms(sum(itl) / max(1, len(itl)))},
        "tpot_ms": {"p50": ms(_pct(tpot, 50)), "p99": ms(_pct(tpot, 99))},
        "e2e_ms": {"p50": ms(_pct(e2e, 50)), "p99": ms(_pct(e2e, 99))},
        "jobs_per_s": round(len(records) / span, 3),
        "span_s": round(span, 3),
        "streamed_tokens": sum(rec["streamed_tokens"] for rec in records),
        "itl_note": "gap between consecutive token events (one event = one engine step's tokens of a job)",
    }
