"""The ``structured`` workload's systems: the same extraction requests JSON-schema-constrained and not.

Issue 21's target is that constraining every request costs at most 15 % of output tok/s. The two sides
must do the same work for that ratio to mean anything, and a constrained request stops where its
grammar ends, not at ``max_tokens``. So the constrained side (``pagedq-json``) runs first, with
``max_tokens`` as a cap; the unconstrained sides then generate exactly the lengths it produced, EOS
ignored, on the same prompts (``exact_lengths``). What differs is the constraint's own cost (the
bitmask fill, its application to the logits, the matcher's advance) and what speculation gains on
each side: constrained sequences draft only what their grammar accepts, or its forced tokens, while
unconstrained ones draft whatever prompt lookup finds. So both sides run with drafts on (the default:
``pagedq-json`` against ``pagedq``) and off (``pagedq-json-nospec`` against ``pagedq-nospec``), and
both ratios are reported.

Grammars are compiled before the clock starts, and their compile times are reported on their own
(first compile, then a cache hit): a worker compiles a schema once in its lifetime, when the first job
that carries it is admitted, so folding a one-off compile into a throughput figure would misstate both.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ops.bench.pagedq_system import PagedqSystem
from ops.bench.system import WARMUP_PROMPT, SystemResult
from ops.bench.workloads import STRUCTURED_SCHEMAS, BenchRequest, Workload

CONSTRAINED = "pagedq-json"
UNCONSTRAINED = "pagedq"
UNCONSTRAINED_NOSPEC = "pagedq-nospec"
CONSTRAINED_NOSPEC = "pagedq-json-nospec"


class StructuredPagedqSystem(PagedqSystem):
    """pagedq offline on the structured workload, every request constrained to its schema or none."""

    def __init__(self, name: str, constrained: bool, num_speculative_tokens: int | None = None) -> None:
        super().__init__(name, caching=True, num_speculative_tokens=num_speculative_tokens)
        self.constrained = constrained
        self.compile_record: dict[str, Any] = {}

    def params(self, workload: Workload) -> list[Any]:
        from engine import SamplingParams

        if not self.constrained:
            return super().params(workload)
        return [
            SamplingParams(max_tokens=r.max_tokens, temperature=0.0, json_schema=STRUCTURED_SCHEMAS[r.schema])
            for r in workload.requests
            if r.schema is not None
        ]

    def prepare(self, llm: Any, workload: Workload) -> None:
        """Time the grammar machinery (the vocabulary walk, then each schema's first compile and a cache
        hit), then warm the constrained step path up on one short request, all before the clock."""
        if not self.constrained:
            return
        from engine import SamplingParams

        engine = llm.engine
        started = time.perf_counter()
        grammars = engine.grammars
        tokenizer_info_s = time.perf_counter() - started
        schemas: dict[str, dict[str, float]] = {}
        for name in dict.fromkeys(r.schema for r in workload.requests if r.schema is not None):
            params = SamplingParams(json_schema=STRUCTURED_SCHEMAS[name])
            started = time.perf_counter()
            grammars.compile(params)
            first = time.perf_counter() - started
            started = time.perf_counter()
            grammars.compile(params)
            hit = time.perf_counter() - started
            schemas[name] = {"first_compile_ms": round(1000 * first, 3), "cache_hit_ms": round(1000 * hit, 4)}
        warm = SamplingParams(max_tokens=4, temperature=0.0, json_schema=STRUCTURED_SCHEMAS["invoice"])
        llm.generate([WARMUP_PROMPT] * 2, warm)
        grammars.reset_timers()
        self.compile_record = {"tokenizer_info_ms": round(1000 * tokenizer_info_s, 2), "schemas": schemas}

    def inspect(self, llm: Any, outs: list[Any], workload: Workload, res: SystemResult) -> None:
        """Constrained: every output must have ended with its grammar (not at the cap) and parse and
        validate against its schema (with ``jsonschema`` when installed: a dev dependency); that, not
        the cap's length, is what ``tokens_ok`` means here. The texts go to the JSON for reading."""
        if not self.constrained:
            return
        try:
            import jsonschema
        except ImportError:  # pragma: no cover - jsonschema is a dev dependency
            jsonschema = None
        texts = [o.outputs[0].text for o in outs]
        stopped = sum(1 for o in outs if o.outputs[0].finish_reason == "stop")
        invalid: list[dict[str, Any]] = []
        for i, (req, text) in enumerate(zip(workload.requests, texts, strict=True)):
            try:
                value = json.loads(text)
                if jsonschema is not None and req.schema is not None:
                    jsonschema.validate(value, STRUCTURED_SCHEMAS[req.schema])
            except Exception as exc:  # json.JSONDecodeError or jsonschema.ValidationError
                invalid.append({"request": i, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        res.bad_requests = max(len(invalid), len(outs) - stopped)
        res.tokens_ok = not invalid and stopped == len(outs) and len(outs) == len(workload.requests)
        res.extra["structured"] = {
            "requests": len(outs),
            "finished_by_grammar": stopped,
            "valid": len(outs) - len(invalid),
            "valid_all": res.tokens_ok,
            "bad_requests": res.bad_requests,
            "validated_with": "jsonschema" if jsonschema is not None else "json.loads only",
            "invalid": invalid,
            "step_s": llm.engine.grammars.timers(),
            "texts": texts,
        }
        res.extra["grammar"] = self.compile_record


def exact_lengths(workload: Workload, outputs: list[list[int]]) -> Workload:
    """``workload`` with each request's ``max_tokens`` set to the length the constrained run produced:
    what the unconstrained sides generate (EOS ignored), so both sides make the same tokens."""
    pairs = zip(workload.requests, outputs, strict=True)
    reqs = [BenchRequest(r.prompt_ids, len(out), schema=r.schema) for r, out in pairs]
    return Workload(workload.name, reqs, dict(workload.params))


def plan(num_speculative_tokens: int | None) -> list[StructuredPagedqSystem]:
    """The constrained system first (the others need its lengths), then the unconstrained one; then
    both with drafts off, unless drafts are off already."""
    systems = [StructuredPagedqSystem(CONSTRAINED, True), StructuredPagedqSystem(UNCONSTRAINED, False)]
    if num_speculative_tokens != 0:
        systems.append(StructuredPagedqSystem(CONSTRAINED_NOSPEC, True, num_speculative_tokens=0))
        systems.append(StructuredPagedqSystem(UNCONSTRAINED_NOSPEC, False, num_speculative_tokens=0))
    return systems
