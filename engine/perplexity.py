"""Perplexity of a token sequence under the engine's own model: the quality measure of quantisation.

The text is cut into non-overlapping windows of ``window`` tokens, each window one prefill from an empty
context (the standard strided evaluation with stride = window), and every token after a window's first is
scored by the log-probability the model gave it. transformers' forward over the same windows is the
reference (tests, README "Quantisation"), so the numbers differ only by the model's arithmetic.

It runs the engine's model directly over KV blocks borrowed from the engine's pool (and given back): the
same forward, kernels and weights (int8, GGUF) that serve requests, without sampling. Call it on an idle
engine (no requests in flight); it is a measuring tool, not a request path.
"""

from __future__ import annotations

import math

import torch

from engine.attention_metadata import AttentionMetadata
from engine.engine import Engine
from engine.model_runner import ModelRunner

LOGIT_ROWS = 256  # rows of logits at a time: [256, vocab] fp32 stays ~50 MB for a 49k vocabulary


@torch.inference_mode()
def window_logprobs(engine: Engine, token_ids: list[int]) -> torch.Tensor:
    """``log p(token[i] | token[:i])`` for i >= 1 within one window (float64, ``len - 1`` values)."""
    n = len(token_ids)
    if n < 2:
        raise ValueError("a window needs at least two tokens")
    if n > engine.max_model_len:
        raise ValueError(f"window of {n} tokens exceeds the engine's max_model_len {engine.max_model_len}")
    runner = engine.runner
    if not isinstance(runner, ModelRunner):
        raise ValueError("perplexity runs the model in this process: use tensor_parallel_size=1")
    bs = engine.config.block_size
    pool = engine.kv.pool
    blocks = pool.allocate(-(-n // bs))
    try:
        block_ids = [b.block_id for b in blocks]
        dev = runner.device
        positions = torch.arange(n, dtype=torch.long)
        table = torch.tensor([block_ids], dtype=torch.int32)
        slots = table[0, positions // bs].long() * bs + positions % bs
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32).to(dev),
            seq_lens=torch.tensor([n], dtype=torch.int32).to(dev),
            block_tables=table.to(dev),
            slot_mapping=slots.to(dev),
            max_query_len=n,
            max_seq_len=n,
            query_lens_cpu=[n],
            seq_lens_cpu=[n],
        )
        ids = torch.tensor(token_ids, dtype=torch.long)
        model = runner.model
        model.ops.attention.prepare(meta)
        hidden = model(ids.to(dev), positions.to(dev), runner.kv_caches, meta)
        targets = ids[1:]
        parts = []
        for start in range(0, n - 1, LOGIT_ROWS):
            stop = min(start + LOGIT_ROWS, n - 1)
            logits = model.compute_logits(hidden[start:stop]).double().cpu()
            parts.append(torch.log_softmax(logits, dim=-1).gather(1, targets[start:stop, None]).squeeze(1))
        return torch.cat(parts)
    finally:
        # The blocks hold this text's K/V without prefix-cache hashes: back to the free list, never matched.
        pool.free([b.block_id for b in reversed(blocks)])


def windows(token_ids: list[int], window: int) -> list[list[int]]:
    """Non-overlapping windows of ``window`` tokens; a last piece shorter than 2 tokens is dropped."""
    if window < 2:
        raise ValueError(f"window must be >= 2, got {window}")
    return [token_ids[i : i + window] for i in range(0, len(token_ids), window) if len(token_ids[i : i + window]) > 1]


def perplexity(engine: Engine, token_ids: list[int], window: int = 512) -> float:
    """``exp(mean negative log-likelihood)`` over every scored token of ``token_ids``."""
    total, count = 0.0, 0
    for chunk in windows(token_ids, window):
        logprobs = window_logprobs(engine, chunk)
        total -= float(logprobs.sum())
        count += logprobs.numel()
    return math.exp(total / count)
