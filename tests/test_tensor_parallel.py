"""Tensor parallelism on CPU (gloo): greedy output of N ranks equals one rank's, token for token.

Each case starts real rank processes (``torch.multiprocessing`` spawn, a ``torch.distributed`` gloo group)
over a tiny checkpoint whose head counts exercise one corner of the split: even head and KV-head splits
(llama_gqa, TP=2), the one KV head replicated on both ranks (MQA with tied embeddings, TP=2), a
vocabulary neither 2 nor 3 divides (padded vocab-parallel embedding and lm_head), q/k/v and o biases
with per-head q/k norms (qwen3). Every case runs the parity workload (20 prompts) with chunked prefill
and preemption forced, then again with the prompts' blocks in the prefix cache.

Starting the ranks costs several seconds (each imports torch and loads its shard: ~10 s a case on 2 cores), so
the default tier keeps the cheap in-process checks of the shard arithmetic; every rank-process case is slow-tier.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.parallel_layers import AttentionShards, TensorParallel, padded_vocab
from tests.test_engine_parity import make_workload

# Chunked prefill (24 tokens a step) and preemption (16 blocks of 16 for 20 prompts of up to 111 tokens and
# 64 new ones; one rank preempts 9-27 times by architecture; at 24 blocks, with greedy loops drafted 8 tokens
# a step, llama_mqa_tied preempted twice on one rank and never on two).
FORCED: dict[str, Any] = {"max_num_batched_tokens": 24, "num_kv_blocks": 16, "enable_prefix_caching": True}


def _cases() -> list[Any]:
    slow = pytest.mark.slow  # each case starts N rank processes (~10-20 s on 2 cores)
    return [
        pytest.param("llama_gqa", 2, marks=slow),
        pytest.param("llama_mqa_tied", 2, marks=slow),
        pytest.param("llama_tp_odd_vocab", 2, marks=slow),
        pytest.param("llama_tp_odd_vocab", 3, marks=slow),
        pytest.param("qwen3", 2, marks=slow),
    ]


def _generate(llm: LLM, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_new]
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize(("arch", "size"), _cases())
def test_greedy_output_equals_one_rank(tiny_model: Callable[[str], Path], arch: str, size: int) -> None:
    path = tiny_model(arch)
    prompts, max_new = make_workload()
    single = LLM(str(path), max_num_seqs=64, **FORCED)
    expected = _generate(single, prompts, max_new)
    one_rank = single.stats()
    with LLM(str(path), max_num_seqs=64, tensor_parallel_size=size, **FORCED) as llm:
        first = _generate(llm, prompts, max_new)
        stats = llm.stats()
        assert stats.num_preemptions > 0, "the workload must force preemption"
        again = _generate(llm, prompts, max_new)  # the prompts' blocks are in the prefix cache now
        cached = llm.stats()
    for i, (ours, exp) in enumerate(zip(first, expected, strict=True)):
        assert ours == exp, f"prompt {i} (len {len(prompts[i])}) diverged from one rank"
    assert again == expected, "rerun from the prefix cache diverged"
    assert cached.prefix_cache_hits > stats.prefix_cache_hits
    assert cached.num_free_blocks == cached.num_total_blocks == one_rank.num_total_blocks
    # Each rank holds its own shard: well under the whole model's weights (norms and, for the replicated
    # KV heads, k/v are held whole by every rank).
    assert stats.tensor_parallel_size == size and len(stats.rank_weight_bytes) == size
    (whole,) = one_rank.rank_weight_bytes
    assert all(0 < w < 0.75 * whole for w in stats.rank_weight_bytes), (stats.rank_weight_bytes, whole)
    assert len(set(stats.rank_kv_bytes)) == 1  # the same blocks, of the same number of heads, on every rank


def test_head_split_replicates_kv_heads_when_fewer_than_ranks(tiny_model: Callable[[str], Path]) -> None:
    mqa = ModelConfig.from_pretrained(tiny_model("llama_mqa_tied"))  # 4 heads, 1 KV head
    shards = [AttentionShards.of(mqa, TensorParallel(rank, 2)) for rank in range(2)]
    placed = [(s.num_heads, s.num_kv_heads, s.head_start, s.kv_head_start) for s in shards]
    assert placed == [(2, 1, 0, 0), (2, 1, 2, 0)]  # both ranks hold KV head 0
    gqa = ModelConfig.from_pretrained(tiny_model("llama_gqa"))  # 4 heads, 2 KV heads
    assert [AttentionShards.of(gqa, TensorParallel(r, 4)).kv_head_start for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="num_attention_heads"):
        AttentionShards.of(gqa, TensorParallel(0, 3))
    assert padded_vocab(511, TensorParallel(0, 3)) == 513 and padded_vocab(512, TensorParallel(0, 2)) == 512


def test_a_model_that_does_not_split_is_refused_before_any_rank_starts(tiny_model: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size=3"):
        LLM(str(tiny_model("llama_mqa_tied")), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(str(tiny_model("llama_mqa_tied")), tensor_parallel_size=0)


def test_each_rank_loads_its_band_of_the_checkpoint(tiny_model: Callable[[str], Path]) -> None:
    """Three ranks' shards, loaded without a process group (loading needs none), put back together equal
    the one-rank model: q/k/v rows by head, gate/up rows and down columns by band, the vocabulary by band
    with zero padding rows."""
    path = tiny_model("llama_tp_odd_vocab")
    cpu = torch.device("cpu")
    full, config = load_model(path, torch.float32, cpu, "torch")
    ranks = [load_model(path, torch.float32, cpu, "torch", TensorParallel(r, 3))[0] for r in range(3)]
    embed = torch.cat([m.embed_tokens.weight for m in ranks])
    assert embed.shape[0] == 513 and torch.equal(embed[:511], full.embed_tokens.weight)
    assert not embed[511:].any()
    assert torch.equal(torch.cat([m.lm_head_weight for m in ranks])[:511], full.lm_head_weight)
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    for layer, parts in zip(_layers(full), zip(*(_layers(m) for m in ranks), strict=True), strict=True):
        qkv = layer.self_attn.qkv_proj.weight
        local = [p.self_attn.qkv_proj.weight for p in parts]
        lq, lkv = q // 3, kv // 3
        assert torch.equal(torch.cat([w[:lq] for w in local]), qkv[:q])
        assert torch.equal(torch.cat([w[lq : lq + lkv] for w in local]), qkv[q : q + kv])
        assert torch.equal(torch.cat([w[lq + lkv :] for w in local]), qkv[q + kv :])
        assert torch.equal(torch.cat([p.self_attn.o_proj.weight for p in parts], 1), layer.self_attn.o_proj.weight)
        gate_up = layer.mlp.gate_up_proj.weight
        li = inter // 3
        assert torch.equal(torch.cat([p.mlp.gate_up_proj.weight[:li] for p in parts]), gate_up[:inter])
        assert torch.equal(torch.cat([p.mlp.gate_up_proj.weight[li:] for p in parts]), gate_up[inter:])
        assert torch.equal(torch.cat([p.mlp.down_proj.weight for p in parts], 1), layer.mlp.down_proj.weight)


def _layers(model: LlamaForCausalLM) -> list[LlamaDecoderLayer]:
    return [cast(LlamaDecoderLayer, layer) for layer in model.layers]
