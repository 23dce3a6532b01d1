"""Tensor parallelism's ranks: rank 0 is the engine's own process, ranks 1..N-1 are processes it starts.

vLLM's "Worker" design. Rank 0 runs everything that decides (scheduler, block manager, sampler); each step
it flattens the batch once (:meth:`ModelRunner.host_inputs`) and broadcasts it to the other ranks, then
every rank runs the same forward over its shard of the model (:mod:`engine.parallel_layers`), whose
all-reduces keep them in lockstep, and rank 0 gathers the logits. The block tables rank 0 hands out are
the same block ids on every rank: each rank's KV cache has the same number of blocks, for its own heads.

Processes and groups:

* ranks start with ``torch.multiprocessing``'s *spawn* context (a forked CUDA or OpenMP runtime is not
  safe), and meet in a ``torch.distributed`` process group over a ``TCPStore`` on 127.0.0.1: NCCL on
  CUDA (one device per rank), gloo on CPU;
* the model's collectives run on that default group, with ``distributed_timeout_s`` as their timeout;
* each step's commands travel on a second, gloo group (host tensors; nothing pickled) with a long
  timeout, because a rank waits there for the next step for as long as the engine has nothing to do;
* on CPU each rank runs ``usable_cpus() // N`` threads (:mod:`engine.cpu_runtime`), so N ranks share the
  cores instead of each starting a thread per core.

Failure: rank 0 checks its ranks' processes before each step, and a collective that fails (a peer's
socket closed) or times out ends the step. Either way the engine raises
:class:`~engine.errors.RankFailedError` from then on: the ranks are out of step and cannot be trusted
again, so the caller (the worker) hands its jobs back and exits for its supervisor to restart it. A
rank whose parent died exits by itself (it watches its parent's pid).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine import cpu_runtime
from engine.config import EngineConfig
from engine.errors import RankFailedError
from engine.model_config import ModelConfig
from engine.model_runner import HostInputs, ModelRunner, logit_rows
from engine.parallel_layers import AttentionShards, TensorParallel
from engine.sampler import GreedyChoice
from engine.scheduler import ScheduledBatch
from engine.step_stats import StepStats

log = structlog.get_logger("pagedq.distributed")

COMMAND_TIMEOUT = timedelta(days=30)
"""How long a rank waits for rank 0's next command: an idle engine sends none."""
PARENT_CHECK_S = 0.5
JOIN_TIMEOUT_S = 10.0

# Commands, the first field of the header rank 0 broadcasts before each one.
STEP, COPY_BLOCKS, SHUTDOWN = 1, 2, 3
HEADER_FIELDS = 8  # command, payload length, tokens, sequences, block-table width, logit rows, copy pairs, spare


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU, or the ``rank``-th CUDA device from the configured one on."""
    base = config.torch_device
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def check_shardable(config: ModelConfig, size: int) -> None:
    """Refuse, before any process starts, a model whose heads or MLP do not split over ``size`` ranks."""
    for rank in range(size):
        tp = TensorParallel(rank, size)
        AttentionShards.of(config, tp)
        tp.split(config.intermediate_size, "intermediate_size")


class DistributedModelRunner:
    """Rank 0's model runner over N ranks: the :class:`ModelRunner` interface the engine drives."""

    def __init__(self, config: EngineConfig, model_path: str, stats: StepStats | None = None) -> None:
        size = config.tensor_parallel_size
        if dist.is_initialized():
            raise RuntimeError("this process already runs a torch.distributed group: one tensor-parallel engine each")
        device = rank_device(config, 0)
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + size:
            raise ValueError(
                f"tensor_parallel_size={size} needs {size} CUDA devices from {device}; "
                f"{torch.cuda.device_count()} are visible"
            )
        check_shardable(ModelConfig.from_pretrained(model_path), size)
        self.config = config
        self.size = size
        self.stats = stats if stats is not None else StepStats()
        self.failure: str | None = None  # why the ranks can no longer step, once they cannot
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=config.distributed_timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timeout, wait_for_workers=False)
        threads = cpu_runtime.threads_per_rank(size)
        spec = {
            "config": dataclasses.asdict(config),
            "model_path": model_path,
            "size": size,
            "port": store.port,
            "backend": backend,
            "threads": threads,
            "parent_pid": os.getpid(),
        }
        context = mp.get_context("spawn")
        self.processes: list[Any] = []
        for rank in range(1, size):
            process = context.Process(
                target=rank_main, args=(rank, json.dumps(spec)), name=f"pagedq-rank-{rank}", daemon=True
            )
            process.start()
            self.processes.append(process)
        try:
            dist.init_process_group(backend, store=store, rank=0, world_size=size, timeout=timeout)
            self.control = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            self.local = ModelRunner(
                config,
                model_path,
                self.stats,
                tp=TensorParallel(0, size),
                device=device,
                agree=lambda blocks: agree_min(blocks, self.control),
            )
            sizes = gather_sizes(self.local, self.control)
        except BaseException:
            self._stop_ranks()
            raise
        self.rank_weight_bytes = [w for w, _ in sizes]
        self.rank_kv_bytes = [k for _, k in sizes]
        self.model_config = self.local.model_config
        self.model = self.local.model
        self.num_blocks = self.local.num_blocks
        self.graphs = None  # no CUDA graphs across ranks (their collectives would have to be captured too)
        log.info(
            "distributed.ready",
            tensor_parallel_size=size,
            backend=backend,
            threads_per_rank=threads,
            rank_pids=[os.getpid(), *(p.pid for p in self.processes)],
            rank_weight_bytes=self.rank_weight_bytes,
            rank_kv_bytes=self.rank_kv_bytes,
        )

    @property
    def weight_bytes(self) -> int:
        return self.local.weight_bytes

    @property
    def kv_bytes(self) -> int:
        return self.local.kv_bytes

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.local.kv_dtype

    @property
    def quantization(self) -> str | None:
        return self.local.quantization

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Not under tensor parallelism: steps run eagerly."""

    # ------------------------------------------------------------------------------ stepping

    def execute(
        self,
        batch: ScheduledBatch,
        sample_rows: list[int],
        num_logits: list[int] | None = None,
        greedy: bool = False,
    ) -> torch.Tensor | GreedyChoice | None:
        """:meth:`ModelRunner.execute` on every rank: the batch is broadcast, the logits come back here (always
        logits: ``greedy`` is a hint the sharded head does not take, its vocabulary split over the ranks)."""
        self._check_ranks()
        t0 = time.perf_counter()
        host = self.local.host_inputs(batch)
        rows = logit_rows(batch, sample_rows, num_logits)
        try:
            self._command(STEP, pack_step(host, rows), len(host.input_ids), len(host.seq_lens),
                          host.block_tables.shape[1], len(rows), 0)  # fmt: skip
            input_ids, positions, meta = self.local.device_inputs(host)
            t1 = time.perf_counter()
            logits = self.local.run(input_ids, positions, meta, rows)
        except Exception as exc:
            raise self._failed(exc) from exc
        self.stats.phase_s["prepare_inputs"] += t1 - t0
        self.stats.phase_s["forward"] += time.perf_counter() - t1
        return logits

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        self._check_ranks()
        flat = torch.tensor([p[0] for p in pairs] + [p[1] for p in pairs], dtype=torch.int64)
        try:
            self._command(COPY_BLOCKS, flat, 0, 0, 0, 0, len(pairs))
        except Exception as exc:
            raise self._failed(exc) from exc
        self.local.copy_blocks(pairs)

    def _command(self, command: int, payload: torch.Tensor, *fields: int) -> None:
        header = torch.tensor([command, payload.numel(), *fields], dtype=torch.int64)
        header = torch.nn.functional.pad(header, (0, HEADER_FIELDS - header.numel()))
        dist.broadcast(header, src=0, group=self.control)
        if payload.numel():
            dist.broadcast(payload, src=0, group=self.control)

    # ------------------------------------------------------------------------------- failure

    def dead_ranks(self) -> dict[int, int]:
        """Rank -> exit code of every rank process that has ended."""
        return {rank: p.exitcode for rank, p in enumerate(self.processes, start=1) if p.exitcode is not None}

    def rank_failure(self) -> str | None:
        """Why the ranks can no longer step (a rank process has ended, or a step broke), else None.
        Cheap (a non-blocking wait per rank): callers poll it while the engine is idle."""
        if self.failure is None and (dead := self.dead_ranks()):
            self.failure = f"tensor-parallel rank(s) died: {_describe(dead)}"
            log.error("distributed.rank_died", ranks=dead)
        return self.failure

    def _check_ranks(self) -> None:
        if self.failure is None and (dead := self.dead_ranks()):
            self.failure = f"tensor-parallel rank(s) died: {_describe(dead)}"
            log.error("distributed.rank_died", ranks=dead)
        if self.failure is not None:
            raise RankFailedError(self.failure)

    def _failed(self, exc: BaseException) -> RankFailedError:
        """The step broke part-way: the ranks are out of step for good. Name a dead rank if there is one
        (a killed peer's socket usually closes before its exit code is reaped: wait a moment for it)."""
        deadline = time.monotonic() + 2.0
        while not (dead := self.dead_ranks()) and time.monotonic() < deadline:
            time.sleep(0.05)
        cause = f"rank(s) died: {_describe(dead)}" if dead else f"a collective failed: {str(exc)[:300]}"
        self.failure = f"tensor-parallel step failed, {cause}"
        log.error("distributed.step_failed", reason=self.failure)
        return RankFailedError(self.failure)

    # ------------------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Stop the ranks (a shutdown command, then kill what is left) and leave the process group."""
        if self.failure is None and not self.dead_ranks():
            try:
                self._command(SHUTDOWN, torch.empty(0, dtype=torch.int64))
            except Exception:
                log.warning("distributed.shutdown_command_failed", exc_info=True)
        self.failure = self.failure or "the engine was closed"
        self._stop_ranks()

    def _stop_ranks(self) -> None:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(JOIN_TIMEOUT_S)
        if dist.is_initialized():
            dist.destroy_process_group()


def _describe(dead: dict[int, int]) -> str:
    return ", ".join(
        f"rank {rank} ({'killed by ' + signal.Signals(-code).name if code < 0 else f'exit code {code}'})"
        for rank, code in sorted(dead.items())
    )


def agree_min(value: int, group: Any) -> int:
    """The smallest of every rank's ``value``: the KV block count all ranks can hold."""
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return int(tensor.item())


def gather_sizes(runner: ModelRunner, group: Any) -> list[tuple[int, int]]:
    """Every rank's (weight bytes, KV cache bytes), in rank order, on every rank."""
    mine = torch.tensor([runner.weight_bytes, runner.kv_bytes], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine, group=group)
    return [(int(t[0]), int(t[1])) for t in every]


def pack_step(host: HostInputs, rows: list[int]) -> torch.Tensor:
    """One step's inputs as one int64 tensor (one broadcast): ids, positions, query starts, sequence
    lengths, block tables, slots, logit rows, which sequences' chunks hold prompt tokens."""
    return torch.cat(
        [
            host.input_ids,
            host.positions,
            host.query_start_loc.long(),
            host.seq_lens.long(),
            host.block_tables.long().flatten(),
            host.slot_mapping,
            torch.tensor(rows, dtype=torch.int64),
            torch.tensor(host.prompt_chunks_cpu, dtype=torch.int64),
        ]
    )


def unpack_step(payload: torch.Tensor, tokens: int, seqs: int, width: int, rows: int) -> tuple[HostInputs, list[int]]:
    """The inverse of :func:`pack_step`, from the sizes in the command's header."""
    parts = payload.split([tokens, tokens, seqs + 1, seqs, seqs * width, tokens, rows, seqs])
    ids, positions, starts, seq_lens, tables, slots, row_ids, prompt_chunks = parts
    query_start_loc = starts.int()
    host = HostInputs(
        input_ids=ids,
        positions=positions,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens.int(),
        block_tables=tables.int().reshape(seqs, width),
        slot_mapping=slots,
        query_lens_cpu=(query_start_loc[1:] - query_start_loc[:-1]).tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        prompt_chunks_cpu=[bool(flag) for flag in prompt_chunks.tolist()],
    )
    return host, row_ids.tolist()


# ---------------------------------------------------------------------------------- other ranks


def rank_main(rank: int, spec_json: str) -> None:
    """Entry point of rank ``rank`` (1..N-1) in its spawned process: join the group, load this rank's
    shard, then run every command rank 0 broadcasts until it says stop (or goes away)."""
    spec = json.loads(spec_json)
    # The parent stops its ranks itself; a Ctrl-C sent to the whole process group must not kill a rank
    # in the middle of a collective before the parent has handed its jobs back.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(spec["parent_pid"],), daemon=True).start()
    torch.set_num_threads(spec["threads"])
    size = spec["size"]
    config = EngineConfig(**spec["config"])
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        cpu_runtime.keep_freed_memory()  # as the engine does for rank 0
    timeout = timedelta(seconds=config.distributed_timeout_s)
    store = dist.TCPStore("127.0.0.1", spec["port"], size, False, timeout=timeout)
    dist.init_process_group(spec["backend"], store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    runner = ModelRunner(
        config,
        spec["model_path"],
        tp=TensorParallel(rank, size),
        device=device,
        agree=lambda blocks: agree_min(blocks, control),
    )
    gather_sizes(runner, control)
    serve(runner, control)
    dist.destroy_process_group()


def serve(runner: ModelRunner, control: Any) -> None:
    """Rank 1..N-1's loop: receive a command, run it, until SHUTDOWN."""
    header = torch.empty(HEADER_FIELDS, dtype=torch.int64)
    while True:
        dist.broadcast(header, src=0, group=control)
        command, length, tokens, seqs, width, rows, pairs, _ = header.tolist()
        payload = torch.empty(length, dtype=torch.int64)
        if length:
            dist.broadcast(payload, src=0, group=control)
        if command == SHUTDOWN:
            return
        with torch.inference_mode():
            if command == STEP:
                host, row_ids = unpack_step(payload, tokens, seqs, width, rows)
                runner.run(*runner.device_inputs(host), row_ids)
            elif command == COPY_BLOCKS:
                src, dst = payload[:pairs].tolist(), payload[pairs:].tolist()
                runner.copy_blocks(list(zip(src, dst, strict=True)))
            else:
                raise RuntimeError(f"unknown tensor-parallel command {command}")


def _watch_parent(parent_pid: int) -> None:
    """Exit when rank 0's process is gone: nothing would ever send this rank another command."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)
