"""The offline API: hand over a list of prompts, get every completion back (vLLM's ``LLM``)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from typing import Any, Required, TypedDict, cast

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.default_model import resolve_model_path
from engine.engine import Engine, Request
from engine.outputs import CompletionOutput, EngineStats, RequestOutput
from schemas.chat_content import text_content
from schemas.sampling import SamplingParams


class TextPrompt(TypedDict):
    """vLLM's ``TextPrompt``: ``{"prompt": "..."}``."""

    prompt: str


class TokensPrompt(TypedDict, total=False):
    """vLLM's ``TokensPrompt``: ``{"prompt_token_ids": [...]}`` (``prompt``, when given, is only reported back)."""

    prompt_token_ids: Required[list[int]]
    prompt: str


# A prompt as vLLM's LLM.generate takes one: text, token ids, or either as a dict.
Prompt = str | list[int] | TextPrompt | TokensPrompt
# A message's content: a string, or OpenAI's list of content parts (text parts only; schemas.chat_content).
Messages = list[dict[str, Any]]
_PROMPT_KEYS = {"prompt", "prompt_token_ids"}


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

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """vLLM's name for :attr:`tokenizer`."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Seq[int] | None = None,
        *,
        params: SamplingParams | Seq[SamplingParams] | None = None,
        priorities: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (all submitted at once, batched continuously); results in input order.

        vLLM's signature: a prompt is text, token ids, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``;
        one ``SamplingParams`` for all or one per prompt; ``priority`` one per prompt (higher first).
        ``params`` and ``priorities`` are pagedq's older names for the same two arguments.

        Every prompt is checked as it is queued, before any step runs: a bad one raises (the note on the
        exception says which prompt), and the ones queued before it are withdrawn, so the engine is left
        as it was.

        A request that fails on its own (its sampling went non-finite, say) does not raise: that would
        throw away every other prompt's result. Its ``RequestOutput.error`` says why and its
        samples' ``finish_reason`` is "error" (vLLM's finish reason for a request that failed inside
        the engine); the other results are exactly what they would have been without it.
        """
        sampling_params = _one_of("sampling_params", sampling_params, "params", params)
        priority = _one_of("priority", priority, "priorities", priorities)
        prompt_list = _as_list(prompts)
        inputs = []
        for i, prompt in enumerate(prompt_list):
            try:
                inputs.append(_prompt_input(prompt))
            except (TypeError, ValueError) as exc:
                if len(prompt_list) > 1:
                    exc.add_note(f"(prompt {i} of the {len(prompt_list)} given; none of them ran)")
                raise
        return self._generate(inputs, sampling_params, priority, use_tqdm)

    def chat(
        self,
        messages: Messages | Seq[Messages],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one chat conversation or a list of them through the chat template (the
        model's, or ``chat_template``), with vLLM's arguments. A message's ``content`` is a string or a list
        of OpenAI content parts, whose text parts are joined by newlines (as vLLM does for text-only
        models); other parts are refused with a ValueError. Each output's ``prompt`` is the rendered text."""
        sampling_params = _one_of("sampling_params", sampling_params, "params", params)
        if add_generation_prompt and continue_final_message:
            # vLLM's rule: a reply cannot both start fresh and continue the last message.
            raise ValueError("continue_final_message=True needs add_generation_prompt=False")
        if messages and isinstance(messages[0], Mapping):
            convs = [cast(Messages, messages)]
        else:
            convs = list(cast(Seq[Messages], messages))
        extra = dict(chat_template_kwargs or {})
        inputs: list[tuple[str | list[int], str | None]] = [
            self._render_chat(c, chat_template, add_generation_prompt, continue_final_message, extra) for c in convs
        ]
        return self._generate(inputs, sampling_params, None, use_tqdm)

    def _render_chat(
        self,
        conversation: Messages,
        chat_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        extra: dict[str, Any],
    ) -> tuple[list[int], str]:
        """A conversation → its prompt ids and text. As ``Engine.chat_prompt_ids`` (the worker's path): the
        template's text, tokenised without special tokens, so no second BOS is added."""
        tokenizer = self.tokenizer
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; pass chat_template= or send a plain prompt instead")
        flat = [
            {**message, "content": text_content(message.get("content"), f"messages[{i}].content")}
            for i, message in enumerate(conversation)
        ]
        if continue_final_message:
            extra["continue_final_message"] = True
        text = str(
            tokenizer.apply_chat_template(
                flat,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **extra,
            )
        )
        ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids, text

    def _generate(
        self,
        inputs: list[tuple[str | list[int], str | None]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None,
        priority: Seq[int] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """``inputs``: (what the engine takes, the prompt text to report) per prompt."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            param_list = [sampling_params or SamplingParams()] * len(inputs)
        else:
            param_list = list(sampling_params)
            if len(param_list) != len(inputs):
                raise ValueError(f"got {len(param_list)} SamplingParams for {len(inputs)} prompts")
        for i, sp in enumerate(param_list):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
        prio = list(priority) if priority is not None else [0] * len(inputs)
        if len(prio) != len(inputs):
            raise ValueError(f"got {len(prio)} priorities for {len(inputs)} prompts")
        return self._run(
            [(p, text, sp, pr) for (p, text), sp, pr in zip(inputs, param_list, prio, strict=True)], use_tqdm
        )

    def _run(
        self, items: list[tuple[str | list[int], str | None, SamplingParams, int]], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.engine
        order: list[str] = []
        results: dict[str, RequestOutput] = {}
        requests: dict[str, Request] = {}  # kept past their end: stop strings are read from their samples
        try:
            for i, (prompt, text, sp, priority) in enumerate(items):
                rid = f"llm-{next(self._ids)}"
                try:
                    engine.add_request(rid, prompt, sp, priority)
                except Exception as exc:
                    if len(items) > 1:
                        exc.add_note(f"(prompt {i} of the {len(items)} given; none of them ran)")
                    raise
                order.append(rid)
                req = requests[rid] = engine.requests[rid]
                results[rid] = RequestOutput(
                    rid,
                    text if text is not None else req.prompt,
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
                        self._complete(out, requests[delta.request_id])
                        bar.update(1)
            bar.close()
        finally:
            for rid in order:
                engine.abort(rid)  # no-op for finished ones; frees blocks if interrupted
        return [results[rid] for rid in order]

    def _complete(self, out: RequestOutput, req: Request) -> None:
        """vLLM's finishing touches on a request's samples: ``stop_reason``, ``cumulative_logprob``,
        the logprobs' decoded tokens, and no text under ``detokenize=False``."""
        params = req.params
        eos = self.engine.eos_token_ids
        for seq in req.seqs:
            c = out.outputs[seq.index]
            if c.finish_reason == "stop":
                if seq.detokenizer.stop_string is not None:
                    c.stop_reason = seq.detokenizer.stop_string
                # EOS ends an output with stop_reason None in vLLM, even when also listed as a stop token.
                elif (
                    c.token_ids
                    and (last := c.token_ids[-1]) in params.stop_token_ids
                    and (params.ignore_eos or last not in eos)
                ):
                    c.stop_reason = last
            if c.logprobs is not None:
                c.cumulative_logprob = sum(lp.logprob for lp in c.logprobs)
                if params.detokenize:
                    decode = self.tokenizer.decode
                    for lp in c.logprobs:
                        lp.decoded = {t: str(decode([t])) for t in lp}
            if not params.detokenize:
                c.text = ""

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


def _one_of(name: str, value: Any, old_name: str, old_value: Any) -> Any:
    """An argument given under vLLM's name or pagedq's older one, not both."""
    if value is not None and old_value is not None:
        raise TypeError(f"give {name} or {old_name}, not both")
    return value if value is not None else old_value


def _as_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """One prompt (text, token ids or a prompt dict) or many -> a list of prompts."""
    if isinstance(prompts, (str, Mapping)):
        return [cast(Prompt, prompts)]
    items = list(prompts)
    # A flat list of anything but prompts is one prompt of token ids: Engine.tokenize then refuses the
    # ones that are not integers by name, rather than each failing as "a prompt".
    if items and not isinstance(items[0], (str, list, tuple, Mapping)):
        return [cast(list[int], items)]
    return cast(list[Prompt], items)


def _prompt_input(prompt: Prompt) -> tuple[str | list[int], str | None]:
    """A prompt -> (what the engine takes: text or token ids, the prompt text to report back). A dict is
    vLLM's TextPrompt or TokensPrompt; a key pagedq does not handle (multi-modal data, ...) is refused
    rather than dropped, and a dict is never read as text or ids itself."""
    if not isinstance(prompt, Mapping):
        return prompt, None
    if unknown := sorted(set(prompt) - _PROMPT_KEYS):
        raise ValueError(f"a prompt dict takes 'prompt' or 'prompt_token_ids'; pagedq does not support {unknown}")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise TypeError(f"a prompt dict's 'prompt' must be a string, got {type(text).__name__}")
    if "prompt_token_ids" in prompt:
        ids = cast(TokensPrompt, prompt)["prompt_token_ids"]
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Seq):
            raise TypeError(f"'prompt_token_ids' must be a list of token ids, got {type(ids).__name__}")
        return list(ids), text
    if text is None:
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return text, None
