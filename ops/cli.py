"""The ``pagedq`` command line: one console script, a subcommand per job."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


def _cmd_prepare_model(args: argparse.Namespace) -> int:
    from engine.default_model import DefaultModelUnavailable, prepare_default_model

    try:
        path = prepare_default_model(force=args.force, log=print)
    except DefaultModelUnavailable as exc:
        print(f"pagedq: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    """Offline generation: the engine in this process, tokens streamed to the terminal."""
    from engine import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    prompts = args.prompt or DEMO_PROMPTS
    for i, text in enumerate(prompts):
        ids = engine.chat_prompt_ids([{"role": "user", "content": text}]) if args.chat else text
        engine.add_request(str(i), ids, params)
    texts = ["" for _ in prompts]
    start = time.perf_counter()
    n_tokens = 0
    while engine.has_unfinished():
        for delta in engine.step():
            for out in delta.outputs:
                texts[int(delta.request_id)] += out.text
                n_tokens += len(out.token_ids)
                if len(prompts) == 1:
                    print(out.text, end="", flush=True)
    elapsed = time.perf_counter() - start
    if len(prompts) > 1:
        for prompt, text in zip(prompts, texts, strict=True):
            print(f"\n>>> {prompt}\n{text.strip()}")
    print(f"\n[{n_tokens} tokens in {elapsed:.1f}s, {n_tokens / elapsed:.1f} tok/s]")
    return 0


DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
    "Explain what a paged KV cache is in one sentence.",
]


def _cmd_demo(args: argparse.Namespace) -> int:
    """The main job. Until the worker lands, an offline generation stands in."""
    return _cmd_generate(argparse.Namespace(
        prompt=[], model=args.model, max_tokens=args.max_tokens, temperature=0.0, seed=None,
        dtype="auto", device="cpu", chat=True,
    ))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedq", description="Queue-driven LLM inference worker (Redis streams, paged KV cache)."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare-model", help="convert the default SmolLM2 model once into the cache folder")
    p.add_argument("--force", action="store_true", help="convert again even if already prepared")
    p.set_defaults(func=_cmd_prepare_model)

    p = sub.add_parser("generate", help="offline generation in this process, streamed to the terminal")
    p.add_argument("prompt", nargs="*", help="prompts (default: a few demo questions)")
    p.add_argument("--model", default=None, help="checkpoint folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="send prompts raw, no chat template")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("demo", help="the main job end to end on the embedded defaults")
    p.add_argument("--model", default=None, help="checkpoint folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
