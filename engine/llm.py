"""The offline API: hand over a list of prompts, get every completion back (vLLM's ``LLM``)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from typing import Any, cast

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.default_model import resolve_model_path
from engine.engine import Engine
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from schemas.sampling import SamplingParams

Prompt = str | list[int]
# A message's content: a string, or OpenAI's list of content parts (text parts only; Engine.chat_prompt_ids).
Messages = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs: object) -> None:
        """``model``: a checkpoint folder, or None (or the default model's name) for the default model,
        prepared on first use; the engine below only ever loads a folder."""
        config = EngineConfig(model=str(resolve_model_path(model)), **engine_kwargs)  # type: ignore[arg-type]
        self.engine = Engine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        priorities: Seq[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (all submitted at once, batched continuously); results in input order.

        A request that fails on its own (its sampling went non-finite, say) does not raise: that would
        throw away every other prompt's result. Its ``RequestOutput.error`` says why and its
        samples' ``finish_reason`` is "error" (vLLM's finish reason for a request that failed inside
        the engine); the other results are exactly what they would have been without it.
        """
        prompt_list = _as_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompt_list)} prompts")
        prio = list(priorities) if priorities is not None else [0] * len(prompt_list)
        return self._run([(p, sp, pr) for p, sp, pr in zip(prompt_list, param_list, prio, strict=True)], use_tqdm)

    def chat(
        self,
        conversations: Messages | Seq[Messages],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to chat conversations through the model's chat template. A message's
        ``content`` is a string or a list of OpenAI content parts, whose text parts are joined by
        newlines (as vLLM does for text-only models); other parts are refused with a ValueError."""
        if conversations and isinstance(conversations[0], dict):
            convs = [cast(Messages, conversations)]
        else:
            convs = list(cast(Seq[Messages], conversations))
        ids: list[Prompt] = [self.engine.chat_prompt_ids(c) for c in convs]
        return self.generate(ids, params, use_tqdm=use_tqdm)

    def _run(self, items: list[tuple[Prompt, SamplingParams, int]], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        order: list[str] = []
        results: dict[str, RequestOutput] = {}
        try:
            for prompt, sp, priority in items:
                rid = f"llm-{next(self._ids)}"
                engine.add_request(rid, prompt, sp, priority)
                order.append(rid)
                req = engine.requests[rid]
                results[rid] = RequestOutput(
                    rid,
                    req.prompt,
                    req.prompt_token_ids,
                    [CompletionOutput(i, "", [], None, [] if sp.logprobs is not None else None) for i in range(sp.n)],
                    0,
                    finished=False,
                )
            bar = tqdm(total=len(order), disable=not use_tqdm, desc="generate", unit="req")
            while engine.has_unfinished():
                for delta in engine.step():
                    out = results[delta.request_id]
                    out.num_cached_tokens = delta.num_cached_tokens
                    if delta.error is not None:
                        out.error = delta.error
                    for d in delta.outputs:
                        c = out.outputs[d.index]
                        c.text += d.text
                        c.token_ids.extend(d.token_ids)
                        if d.finish_reason is not None:
                            c.finish_reason = d.finish_reason
                        if c.logprobs is not None and d.logprobs:
                            c.logprobs.extend(d.logprobs)
                    if delta.finished:
                        out.finished = True
                        bar.update(1)
            bar.close()
        finally:
            for rid in order:
                engine.abort(rid)  # no-op for finished ones; frees blocks if interrupted
        return [results[rid] for rid in order]

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks, if any (a no-op on one rank)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        self = cls.__new__(cls)
        self.engine = Engine(dataclasses.replace(config, model=str(resolve_model_path(config.model))))
        self._ids = itertools.count()
        return self


def _as_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) or many -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    # A flat list of anything but prompts is one prompt of token ids: Engine.tokenize then refuses the
    # ones that are not integers by name, rather than each failing as "a prompt".
    if items and not isinstance(items[0], (str, list, tuple)):
        return [cast(list[int], items)]
    return cast(list[Prompt], items)
