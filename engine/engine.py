"""The step-level engine: requests in, one batched forward per step, per-request deltas out.

This is the API the worker drives: ``add_request``, ``step``, ``abort``, ``has_unfinished``.
Everything runs on the caller's thread; the engine is not thread-safe by design (one engine
thread, like vLLM's engine core), which keeps the hot loop free of locks.

``step_stats`` (:class:`~engine.step_stats.StepStats`) is the engine's own account of its steps:
batch sizes and the time of each phase, kept by every step at the cost of a few clock reads.

A request whose sampling fails (its parameters made the arithmetic non-finite, or the sampler raised
on its rows) fails alone: ``step()`` ends it, frees its blocks and reports it in its delta's
``error``, and the other requests of the batch get the tokens they would have got without it.
"""

from __future__ import annotations

import json
import numbers
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine import cpu_runtime, smoothing
from engine.block_pool import NoFreeBlocks
from engine.checkpoint import checkpoint_folder, gguf_file
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import PromptTooLongError
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.ngram_proposer import NgramIndex
from engine.outputs import CompletionDelta, EngineStats, RequestDelta, TokenLogprobs
from engine.sampler import (
    FAILED_TOKEN,
    GreedyChoice,
    Sampler,
    SamplerOutput,
    SamplingRow,
    make_generator,
    plain_greedy,
)
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.step_stats import BLOCK_FILL_EVERY_STEPS, StepStats
from engine.structured import GrammarCache
from schemas.chat_content import text_content
from schemas.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.distributed import DistributedModelRunner

log = structlog.get_logger("pagedq.engine")

COMPILE_POLL_S = 0.02
"""Longest a step waits for a grammar's compile when it has nothing else to run: short, so that a caller
stepping in a loop (the worker's engine thread) still sees new jobs and cancellations promptly."""


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    num_finished: int = 0  # samples that have ended (a request ends when all n have)
    error: str | None = None  # why sampling failed; the request then ends at once, all n samples
    grammar: Any = None  # structured output: the compiled grammar each sample's matcher starts from

    @property
    def finished(self) -> bool:
        return self.error is not None or self.num_finished == self.params.n


class Engine:
    def __init__(self, config: EngineConfig | None = None, **kwargs: object) -> None:
        config = config or EngineConfig(**kwargs)  # type: ignore[arg-type]
        self.config = config
        if config.torch_device.type == "cpu":
            # OpenMP's default is a thread per CPU of the affinity mask, quota or not: cap it at what this
            # process may run at once (engine/cpu_runtime.py). A lower count set by the caller stands.
            threads = cpu_runtime.threads_per_rank(config.tensor_parallel_size)
            if torch.get_num_threads() > threads:
                torch.set_num_threads(threads)
            cpu_runtime.keep_freed_memory()  # a step's tensors reuse freed memory instead of faulting it in
        # ...and fit it, while running, to the cores other processes leave free (cpu_runtime.CoreShare).
        self.core_share: cpu_runtime.CoreShare | None = None
        # Not under tensor parallelism: the other ranks' CPU time would read as a neighbour's.
        if config.torch_device.type == "cpu" and config.adapt_cpu_threads and config.tensor_parallel_size == 1:
            self.core_share = cpu_runtime.CoreShare(torch.get_num_threads())
        self.model_path = checkpoint_folder(config.model)
        gguf = gguf_file(self.model_path)
        if gguf is not None:
            from engine.gguf_checkpoint import load_tokenizer

            self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(gguf)
        else:
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self.step_stats = StepStats()  # every step's phases and batch sizes; reset() between measurements
        self.runner: ModelRunner | DistributedModelRunner
        if config.tensor_parallel_size > 1:
            from engine.distributed import DistributedModelRunner

            self.runner = DistributedModelRunner(config, str(self.model_path), self.step_stats)
        else:
            calibration = None
            if config.quantization == "w8a8":  # the activation smoothing's calibration text, tokenised
                calibration = smoothing.calibration_ids(
                    lambda text: list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
                )
            self.runner = ModelRunner(config, str(self.model_path), self.step_stats, calibration_ids=calibration)
        mc = self.model_config = self.runner.model_config
        capacity = self.runner.num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or mc.max_model_len, mc.max_model_len, capacity)
        self.eos_token_ids = _eos_token_ids(self.model_path, mc.eos_token_ids, self.tokenizer)
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            salt=f"{self.model_path}:{config.torch_dtype}",
        )
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._grammars: GrammarCache | None = None  # built by the first constrained request
        # Constrained requests waiting for their grammar's compile, with its future (in arrival order).
        self._compiling: dict[str, tuple[Request, Future[tuple[Any, float]]]] = {}
        self.num_draft_tokens = 0  # speculative decoding: drafts verified, and accepted, since start
        self.num_accepted_tokens = 0
        model = getattr(self.runner, "model", None)  # one rank's model (int8 panels load on one rank only)
        self.int8_fused_rows = model.int8_fused_rows() if model is not None else 0
        self.runner.capture_cuda_graphs(config.max_num_seqs, self.max_model_len)
        runner = self.runner
        # Memory per rank (one entry without tensor parallelism): weights as held (packed copies
        # included), and the KV cache of the rank's heads.
        self.rank_weight_bytes = getattr(runner, "rank_weight_bytes", None) or [runner.weight_bytes]
        self.rank_kv_bytes = getattr(runner, "rank_kv_bytes", None) or [runner.kv_bytes]
        torch.manual_seed(config.seed)
        self.kernel_variant: str | None = None
        if config.torch_device.type == "cpu":
            from pagedq_kernels import cpu_isa

            self.kernel_variant = cpu_isa.current().kernel_variant
        log.info(
            "engine ready",
            model=str(self.model_path),
            architecture=mc.architecture,
            dtype=str(config.torch_dtype).removeprefix("torch."),
            activations=str(config.activation_dtype).removeprefix("torch."),
            kernel_variant=self.kernel_variant,
            device=config.device,
            backend=config.backend,
            kv_blocks=self.runner.num_blocks,
            tensor_parallel_size=config.tensor_parallel_size,
            kv_cache_dtype=str(self.runner.kv_dtype).removeprefix("torch."),
            block_size=config.block_size,
            max_model_len=self.max_model_len,
        )

    # ------------------------------------------------------------------ requests

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids: list[int] = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, (list, tuple)):
            ids = _token_ids(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        else:
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def chat_prompt_ids(self, messages: Seq[Mapping[str, Any]]) -> list[int]:
        """Apply the model's chat template (already tokenised, so no second BOS is added). A message's
        content may be OpenAI's list of content parts: its text parts are joined (``schemas.chat_content``)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; send a plain prompt instead")
        flat = [
            {**message, "content": text_content(message.get("content"), f"messages[{i}].content")}
            for i, message in enumerate(messages)
        ]
        text = self.tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
        ids: list[int] = self.tokenizer(str(text), add_special_tokens=False)["input_ids"]
        return ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        *,
        strict_max_tokens: bool = False,
    ) -> None:
        """Queue a request. A prompt that leaves no room for one token is refused (:class:`PromptTooLongError`);
        one that leaves fewer than ``max_tokens`` stops at the context (``finish_reason`` ``length``), as
        vLLM's offline ``LLM`` does, unless ``strict_max_tokens`` asks for the refusal OpenAI's API gives."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        params = params or SamplingParams()
        self.scheduler.check_n(params.n)  # before any work: n > max_num_seqs could never be scheduled
        vocab = self.model_config.vocab_size
        if params.logit_bias and (bad := sorted(t for t in params.logit_bias if t >= vocab)):
            raise ValueError(f"logit_bias: token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len)
        if strict_max_tokens and len(ids) + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len, params.max_tokens)
        # ValueError: refused. A grammar not compiled yet comes as a future: the request waits out of the
        # scheduler (in _compiling) while the compile thread works, so no step waits for it.
        grammar = self.grammars.prepare(params) if params.structured else None
        compiling = grammar if isinstance(grammar, Future) else None
        if compiling is not None:
            grammar = None
        seq = self._new_sequence(request_id, 0, ids, len(ids), params, priority, grammar)
        seq.pending_fork = params.n > 1
        if compiling is None:
            self.scheduler.add(seq)  # raises before the request is recorded, so a refusal leaves nothing behind
        else:  # add's own refusal, made now: at admission, in a step, it would fail every request in the batch
            self.scheduler.check_n(params.n)
        req = Request(request_id, prompt if isinstance(prompt, str) else None, ids, params, [seq], grammar=grammar)
        self.requests[request_id] = req
        if compiling is not None:
            self._compiling[request_id] = (req, compiling)

    @property
    def grammars(self) -> GrammarCache:
        """The compiled-grammar cache, built on first use: it walks the whole vocabulary once, which an
        engine that never sees a constrained request should not pay for."""
        if self._grammars is None:
            # Compiles run beside the steps: on the CPU, one compile thread leaves the forward its cores (a
            # 20,000-value enum on 2 cores: 2 threads stretched the median step 0.7 -> 4.6 ms, 1 thread to
            # 0.8 ms, and compiled as fast, 3.0 s).
            threads = 1 if self.config.torch_device.type == "cpu" else 2
            self._grammars = GrammarCache(
                self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids), max_threads=threads
            )
        return self._grammars

    def _new_sequence(
        self,
        request_id: str,
        index: int,
        token_ids: list[int],
        num_prompt: int,
        params: SamplingParams,
        priority: int,
        grammar: Any = None,
    ) -> Sequence:
        return Sequence(
            request_id=request_id,
            index=index,
            token_ids=list(token_ids),
            num_prompt_tokens=num_prompt,
            params=params,
            priority=priority,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                token_ids[:num_prompt],
                params.stop or [],
                params.skip_special_tokens,
                min_tokens=params.min_tokens,
                include_stop_str=params.include_stop_str_in_output,
            ),
            generator=make_generator(params.seed, index),
            logprobs=[] if params.logprobs is not None else None,
            matcher=None if grammar is None else GrammarCache.matcher(grammar),
        )

    def abort(self, request_id: str) -> bool:
        """Stop a request now and give its blocks back; returns False if it was not here."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if self._compiling.pop(request_id, None) is not None:  # never reached the scheduler
            req.seqs[0].status = SequenceStatus.FINISHED
            req.seqs[0].finish_reason = "abort"
            return True
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.finish_reason = "abort"
        return True

    def close(self) -> None:
        """Release what outlives the engine object: under tensor parallelism, its rank processes."""
        self.runner.close()

    def rank_failure(self) -> str | None:
        """Under tensor parallelism, why the engine can no longer step (a rank died), else None; always
        None on one rank. Lets an idle caller notice a lost rank without waiting for the next step."""
        check = getattr(self.runner, "rank_failure", None)
        return None if check is None else check()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._compiling)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestDelta]:
        """Schedule, run one forward, sample, append; the requests that changed, as deltas.

        The time of the step and of each phase goes to ``step_stats``, then the KV usage after it."""
        started = time.perf_counter()
        if self.core_share is not None and (threads := self.core_share.poll()) is not None:
            torch.set_num_threads(threads)
            log.info("cpu threads", threads=threads, others_cores=round(self.core_share.others_cores, 2))
        deltas = self._admit_compiled() if self._compiling else []
        deltas += self._run_step()
        self.step_stats.step_s += time.perf_counter() - started
        self._record_kv_usage()
        return deltas

    def _admit_compiled(self) -> list[RequestDelta]:
        """Schedule the requests whose grammar has compiled since the last step (each keeps its place in
        line: its arrival was set when it was added); end those whose compile failed, with the
        compiler's message as their error (``invalid_request`` on the wire). With nothing else to run,
        wait a little for a compile rather than spin: the compile thread needs the cores."""
        if not self.scheduler.has_unfinished():
            wait([f for _, f in self._compiling.values()], timeout=COMPILE_POLL_S, return_when=FIRST_COMPLETED)
        self.grammars.harvest()  # into the LRU, for the requests that send the same constraint next
        deltas = []
        for request_id, (req, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            seq = req.seqs[0]
            if (error := future.exception()) is not None:
                req.error = str(error)
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "error"
                log.info("structured output: the constraint did not compile", request_id=request_id, error=req.error)
                deltas.append(self._delta(req))
                continue
            req.grammar = future.result()[0]
            seq.matcher = GrammarCache.matcher(req.grammar)
            self.scheduler.add(seq)
        return deltas

    def _run_step(self) -> list[RequestDelta]:
        stats = self.step_stats
        clock = time.perf_counter
        started = clock()
        batch = self.scheduler.schedule()
        stats.phase_s["schedule"] += clock() - started
        if not batch:
            return []
        stats.record_batch(batch.total_tokens, len(batch.seqs))
        sample_rows: list[int] = []
        num_logits: list[int] = []  # per sampled sequence: 1 + its draft tokens
        for i, seq in enumerate(batch.seqs):
            past_end = seq.num_computed_tokens + batch.num_new_tokens[i] - seq.num_tokens
            if past_end >= 0:
                sample_rows.append(i)
                num_logits.append(past_end + 1)
        # Every sampled row plain greedy (no logprobs, penalties, bans, grammar or forks): their argmax will do,
        # and the head computes it without writing the logits where its kernel can (runner.execute's greedy).
        greedy = bool(sample_rows) and all(
            plain_greedy(seq.params, len(seq.output_token_ids)) and seq.matcher is None and not seq.pending_fork
            for seq in (batch.seqs[i] for i in sample_rows)
        )
        logits = self.runner.execute(batch, sample_rows, num_logits, greedy)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            # Drafts' KV counts as computed only once the model has accepted them (below).
            seq.num_computed_tokens += n - len(seq.spec_token_ids)
            self.kv.commit(seq)
        if logits is None:
            return []

        # (sequence, logits rows): forked samples share their parent's row; a speculating
        # sequence has one row per position, each scored as if the drafts before it were accepted.
        samplers: list[tuple[Sequence, int]] = []
        logit_rows: list[int] = []
        copies: list[tuple[int, int]] = []
        offset = 0
        for i, count in zip(sample_rows, num_logits, strict=True):
            seq = batch.seqs[i]
            group = [seq]
            if seq.pending_fork:
                seq.pending_fork = False
                group += self._fork(seq, copies)
            for member in group:
                samplers.append((member, count))
                logit_rows.extend(range(offset, offset + count))
            offset += count
        self.runner.copy_blocks(copies)
        if len(logit_rows) != logits.shape[0]:  # forks: never with a GreedyChoice (no forks there)
            assert isinstance(logits, torch.Tensor)
            logits = logits[torch.tensor(logit_rows, device=logits.device)]
        rows = [
            SamplingRow(
                s.params,
                s.generator,
                s.prompt_token_ids,
                s.output_token_ids + s.spec_token_ids[:j],
                constrained=s.matcher is not None,
            )
            for s, count in samplers
            for j in range(count)
        ]
        started = clock()
        if any(s.matcher is not None for s, _ in samplers):
            assert isinstance(logits, torch.Tensor)  # a grammar's rows are never plain greedy
            # A constrained sequence has one logits row, or one per draft plus one when it
            # speculates (each masked with the grammar's state after the drafts before it). In
            # place: the sampled distribution and the logprobs are those of the allowed tokens.
            constrained = []
            row = 0
            for s, count in samplers:
                if s.matcher is not None:
                    constrained.append((row, s.matcher, s.spec_token_ids[: count - 1]))
                row += count
            self.grammars.apply_bitmasks(logits, constrained)
        out = self._sample(logits, rows, [count for _, count in samplers])
        stats.phase_s["sample"] += clock() - started

        started = clock()
        touched: dict[str, Request] = {}
        failed: dict[str, str] = {}  # request id -> why its sampling failed
        at = 0
        for seq, count in samplers:
            if seq.request_id not in failed:  # a failed request's other samples take nothing more
                tokens, logprobs = out.token_ids[at : at + count], out.logprobs[at : at + count]
                reason = self._accept(seq, tokens, logprobs, out.failed, at)
                if reason is not None:
                    failed[seq.request_id] = reason
            at += count
            touched[seq.request_id] = self.requests[seq.request_id]
        for request_id, reason in failed.items():
            self._fail(touched[request_id], reason)
        stats.phase_s["append_tokens"] += clock() - started
        self._propose_drafts()
        return [self._delta(req) for req in touched.values()]

    def _sample(self, logits: torch.Tensor | GreedyChoice, rows: list[SamplingRow], counts: list[int]) -> SamplerOutput:
        """Sample the batch; should the sampler raise, sample each sequence's rows (``counts`` of them,
        in order) alone, so that only the sequences that raise by themselves fail. The logits are
        already computed, so the retry costs no forward. The seeded generators are put back first:
        the failed call may have drawn from some, and a seeded request's tokens must not depend on
        what shared its batch. (``get_state`` measured 2.4 us per generator on the CPU.)"""
        saved = {id(r.generator): r.generator for r in rows if r.generator is not None and not r.params.greedy}
        states = [(gen, gen.get_state()) for gen in saved.values()]
        try:
            return self.sampler.sample(logits, rows)
        except Exception:  # unknown by definition: whatever it is, it must not fail the batch
            log.warning("sampling the batch raised; sampling each sequence alone", rows=len(rows), exc_info=True)
        for gen, state in states:
            gen.set_state(state)
        token_ids: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        failed: dict[int, str] = {}
        at = 0
        for count in counts:
            try:
                part = self.sampler.sample(logits[at : at + count], rows[at : at + count])
            except Exception as exc:
                reason = _failure_reason(exc)
                token_ids += [FAILED_TOKEN] * count
                logprobs += [None] * count
                failed.update((at + j, reason) for j in range(count))
            else:
                token_ids += part.token_ids
                logprobs += part.logprobs
                failed.update((at + j, why) for j, why in part.failed.items())
            at += count
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, failed=failed)

    def _accept(
        self,
        seq: Sequence,
        tokens: list[int],
        logprobs: list[TokenLogprobs | None],
        failed: dict[int, str],
        at: int,
    ) -> str | None:
        """Append the model's tokens: the first always, then one more per draft it agreed with.

        ``failed`` holds the step's failed rows (``tokens[j]`` is row ``at + j``). Returns the reason of
        the first failed row this reaches, and then the whole request must fail; a failed row behind
        a rejected draft is never reached, exactly as its token would never have been used."""
        drafts = seq.spec_token_ids
        accepted = 0
        reason = None
        for j, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            if failed and (reason := failed.get(at + j)) is not None:
                break
            if seq.matcher is not None and not self.grammars.accept(seq.matcher, token):
                # The bitmask allowed only tokens the grammar accepts; reaching here is a bug, and the
                # request cannot go on with a matcher out of step with its tokens.
                reason = f"structured output: the grammar rejected token {token}"
                break
            self._append_token(seq, token, lp)
            if seq.is_finished or j == len(drafts) or token != drafts[j]:
                break
            accepted += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        if drafts:
            seq.draft_pace.record_drafts(len(drafts), accepted)
        elif reason is None and tokens:
            seq.draft_pace.record_token(tokens[0])
        seq.spec_token_ids = []
        if accepted and not seq.is_finished:
            seq.num_computed_tokens += accepted  # the accepted drafts' KV was written this step
            self.kv.commit(seq)
        return reason

    def _fail(self, req: Request, reason: str) -> None:
        """End a request whose sampling failed, all its samples at once, and give their blocks back now
        (as ``abort`` does): a request whose parameters cannot be sampled would fail again at every
        step. Samples still going end with finish_reason "error"; this step's delta carries ``reason``
        as its ``error``."""
        req.error = reason
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.remove(seq)
                seq.finish_reason = "error"
        log.warning("request failed in sampling", request_id=req.request_id, error=reason)

    def _propose_drafts(self) -> None:
        """Draft tokens for the next step (prompt lookup) for decoding greedy sequences: all of them while
        the batch is small enough for extra positions to ride along with the weights' memory traffic,
        past that only those whose drafts keep coming true (engine/draft_pace.py); the others' proposals
        are only noted, to earn that trust without costing a row."""
        config = self.config
        k_max = config.num_speculative_tokens
        running = self.scheduler.running
        if not k_max:
            return
        past_limit = len(running) > config.draft_batch_limit
        if past_limit and config.speculative_disable_by_batch_size is not None:
            return  # a limit the user set is a hard one, as vLLM's knob of the same name
        # A lone sequence over int8 linears (a GGUF) verifies at most int8_fused_rows rows, so its steps stay on
        # the kernel's fused path: past it a step costs ~1.7x (9 rows 21 ms, 6 rows 13 ms, 1 row 8 ms for
        # SmolLM2's linears on a 2-vCPU Zen 3), and 5 drafts beat 8 for one sequence of the package GGUF on
        # prose, a count, code and a repetition (113.8 / 97.5 / 148.8 / 115.7 tok/s against 96.3 / 65.1 / 119.5
        # / 119.3). Batches of several keep num_speculative_tokens: their steps are past it either way.
        if len(running) == 1 and self.int8_fused_rows > 1:
            k_max = min(k_max, self.int8_fused_rows - 1)
        for seq in running:
            if not seq.params.greedy or not seq.is_decoding:
                continue
            k = min(k_max, seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
            if k <= 0:
                continue
            if seq.ngram_index is None:
                seq.ngram_index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
            shadow = past_limit and not seq.draft_pace.trusted  # only its first token is noted
            drafts = seq.ngram_index.propose(seq.token_ids, 1 if shadow else k)
            if shadow:
                seq.draft_pace.propose_in_shadow(drafts[0] if drafts and seq.matcher is None else None)
                continue
            if seq.matcher is not None:  # only drafts its grammar accepts, or its forced tokens
                drafts = self.grammars.draft(seq.matcher, drafts, k)
            seq.spec_token_ids = drafts

    def _fork(self, parent: Sequence, copies: list[tuple[int, int]]) -> list[Sequence]:
        """The other samples of an n > 1 request, sharing the parent's prompt blocks."""
        req = self.requests[parent.request_id]
        children = []
        for index in range(1, parent.params.n):
            child = self._new_sequence(
                parent.request_id,
                index,
                parent.token_ids,
                parent.num_prompt_tokens,
                parent.params,
                parent.priority,
                req.grammar,
            )
            child.arrival = parent.arrival
            child.num_cached_tokens = parent.num_cached_tokens
            try:
                forked = self.kv.fork(parent, child)
            except NoFreeBlocks:  # no block for the copy: recompute later (prefix cache helps)
                self.scheduler.add(child)
            else:
                child.num_computed_tokens = parent.num_computed_tokens
                if forked.copy is not None:
                    copies.append(forked.copy)
                self.scheduler.add_running(child)
            req.seqs.append(child)
            children.append(child)
        return children

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprobs | None) -> None:
        seq.token_ids.append(token)
        seq.new_token_ids.append(token)
        if seq.logprobs is not None and lp is not None:
            seq.logprobs.append(lp)
            seq.new_text_offsets.append(seq.detokenizer.decoded_length)
        params = seq.params
        n_out = seq.num_output_tokens
        # A token that ends the output (EOS, a stop token, or the EOS that completes a grammar) stays in
        # token_ids, but its text is left out of the text, as vLLM does unless include_stop_str_in_output:
        # it is never detokenized, so no streamed delta can carry it.
        stop_token = (seq.matcher is not None and seq.matcher.is_terminated()) or (
            n_out >= params.min_tokens
            and ((not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids)
        )
        if not stop_token or params.include_stop_str_in_output:
            started = time.perf_counter()
            seq.new_text += seq.detokenizer.add_tokens([token])
            self.step_stats.phase_s["detokenize"] += time.perf_counter() - started
        reason = None
        if stop_token or seq.detokenizer.stopped:
            reason = "stop"
        elif n_out >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is None:
            return
        if not seq.detokenizer.stopped:
            started = time.perf_counter()
            seq.new_text += seq.detokenizer.flush()
            self.step_stats.phase_s["detokenize"] += time.perf_counter() - started
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        self.requests[seq.request_id].num_finished += 1

    def _delta(self, req: Request) -> RequestDelta:
        outputs = []
        for seq in req.seqs:
            # A failed request's samples that ended with it are reported even without new tokens, so
            # each sample's last delta names its finish_reason ("error"); the request ends here.
            ended_by_error = req.error is not None and seq.finish_reason == "error"
            if not seq.new_token_ids and not seq.new_text and not ended_by_error:
                continue
            logprobs = offsets = None
            if seq.logprobs is not None:
                logprobs = seq.logprobs[seq.new_logprobs_from :]
                seq.new_logprobs_from = len(seq.logprobs)
                offsets, seq.new_text_offsets = seq.new_text_offsets, []
            outputs.append(
                CompletionDelta(seq.index, seq.new_text, seq.new_token_ids, seq.finish_reason, logprobs, offsets)
            )
            seq.new_text = ""
            seq.new_token_ids = []
        finished = req.finished
        if finished:
            del self.requests[req.request_id]
        return RequestDelta(
            req.request_id, outputs, finished, req.prompt_token_ids, req.seqs[0].num_cached_tokens, req.error
        )

    # ------------------------------------------------------------------ introspection

    def _record_kv_usage(self) -> None:
        """Keep the peak KV usage; while block fill is tracked, measure it at each new peak and every
        few steps (it walks the block tables, so its time is kept apart from the step's)."""
        stats = self.step_stats
        usage = self.kv.usage()
        new_peak = usage > stats.peak_kv_usage
        if new_peak:
            stats.peak_kv_usage = usage
        if stats.track_block_fill and (new_peak or stats.steps % BLOCK_FILL_EVERY_STEPS == 0):
            started = time.perf_counter()
            filled, allocated = self.kv.filled_slots(self.scheduler.running)
            stats.record_block_fill(filled, allocated, at_peak=new_peak)
            stats.block_fill_s += time.perf_counter() - started

    def stats(self) -> EngineStats:
        kv = self.kv
        queried = kv.num_queried_tokens
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage(),
            prefix_cache_hit_rate=kv.num_hit_tokens / queried if queried else 0.0,
            prefix_cache_queries=queried,
            prefix_cache_hits=kv.num_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_total_blocks,
            spec_draft_tokens=self.num_draft_tokens,
            spec_accepted_tokens=self.num_accepted_tokens,
            kernel_variant=self.kernel_variant,
            matmul_dtype=str(self.config.matmul_weight_dtype).removeprefix("torch."),
            tensor_parallel_size=self.config.tensor_parallel_size,
            rank_weight_bytes=self.rank_weight_bytes,
            rank_kv_bytes=self.rank_kv_bytes,
            kv_cache_dtype=str(self.runner.kv_dtype).removeprefix("torch."),
            weight_bytes=sum(self.rank_weight_bytes),  # every rank's
            kv_cache_bytes=sum(self.rank_kv_bytes),
            quantization=self.runner.quantization,
        )


def _token_ids(prompt: list[int] | tuple[int, ...]) -> list[int]:
    """Prompt token ids as ints, refusing anything that is not an integer: ``int(1.5)`` would quietly run
    token 1, and ``True`` is an int to Python but no token id anyone meant."""
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"prompt token ids must be integers; position {i} is {t!r} ({type(t).__name__})")
    return [int(t) for t in prompt]


def _failure_reason(exc: Exception) -> str:
    """The error a request gets when sampling its rows raised: the exception's first line, kept short
    because it travels to the producer (torch's messages can run to many lines of internals)."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    return f"sampling failed: {first[:200]}"


def _eos_token_ids(model_path: Path, config_eos: list[int], tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """EOS ids as transformers' ``generate`` uses them: generation_config first, then config, tokenizer."""
    gen = model_path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            return set(eos if isinstance(eos, list) else [eos])
    if config_eos:
        return set(config_eos)
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
