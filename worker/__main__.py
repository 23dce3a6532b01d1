"""``python -m worker [--redis-url URL] [--model PATH] [--queue NAME] [--name NAME] ...``

Every setting of :class:`worker.settings.Settings` is a flag (``--max-num-seqs 8``) and an env var
(``PAGEDQ_MAX_NUM_SEQS=8``); flags win. ``pagedq worker`` in ``ops/cli.py`` is the same thing.

Before the model loads, the worker builds the CPU kernels and logs which kernel path it will run
(``worker.kernels``): a missing C compiler breaks nothing, it only makes every step slower, which nobody
notices unless it is said at start, once, where an operator looks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from collections.abc import Sequence
from typing import Any

from pydantic.fields import FieldInfo

from worker.settings import ENV_PREFIX, Settings, SettingsError, load_settings

C_KERNELS = ("cpu_gemm", "cpu_attention", "cpu_ops")
"""The C sources (``pagedq_kernels/csrc``) behind the CPU path: matmuls, paged attention, fused norms/rotary/SiLU."""


def _help(name: str, info: FieldInfo) -> str:
    """The field's description, its choices and its default, so ``--help`` alone is enough to run a worker."""
    parts = [info.description or ""]
    choices = typing.get_args(info.annotation) if typing.get_origin(info.annotation) is typing.Literal else ()
    if choices:
        parts.append("one of " + ", ".join(map(str, choices)))
    default: Any = info.default
    if name == "name":
        default = "<host>-<pid>"
    elif info.default_factory is not None:
        factory: Any = info.default_factory  # data_dir's: the XDG data folder (takes no arguments)
        default = factory()
    if isinstance(default, bool):
        parts.append(f"default: {'on' if default else 'off'}")
    elif default not in (None, []):
        parts.append(f"default: {default}")
    parts.append(f"env {ENV_PREFIX}{name.upper()}")
    text = parts[0]
    details = "; ".join(p for p in parts[1:] if p)
    return f"{text} ({details})" if text else details


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedq worker",
        description="Run a pagedq worker. Every flag is also a PAGEDQ_* environment variable; flags win.",
    )
    parser.add_argument("--print-config", action="store_true", help="print the effective settings and exit")
    parser.add_argument("--config", default=None, help="TOML or JSON settings file (also PAGEDQ_CONFIG)")
    for name, info in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_text = _help(name, info)
        if info.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_text)
    return parser


def kernel_path(settings: Settings) -> tuple[bool, dict[str, Any]]:
    """Which kernels pagedq's engine will run with these settings: ``(fast, fields for the log line)``.

    On the CPU this builds the C kernels now (each is cached on disk, so this costs a hash per source
    when they were built before), which is what the engine would do while loading the model anyway.
    ``fast`` is False when a CPU worker runs any part on the torch fallback.
    """
    import torch

    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        return True, {"path": "cuda", "device": device}
    from engine.config import EngineConfig
    from pagedq_kernels import c_build, cpu_attention, cpu_isa, cpu_linear, cpu_ops

    config = EngineConfig(dtype=settings.dtype, device=device)  # resolves auto as the engine will
    dtype = config.torch_dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return False, {"path": "torch", "device": device, "reason": f"the C kernels serve fp32 and bf16, not {dtype}"}
    isa = cpu_isa.current()
    if dtype == torch.bfloat16 and not isa.bf16_matmul:
        reason = f"this CPU runs no bf16 products (probed: {', '.join(isa.levels) or 'baseline'}): use float32"
        return False, {"path": "torch", "device": device, "dtype": "bfloat16", "reason": reason}
    matmul = [*cpu_linear.available_kinds(dtype), "torch"][0]  # panels (fp32), amx or dpbf16 (bf16), onednn, torch
    fields: dict[str, Any] = {
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),  # the choice auto made (bf16 where AMX or fast dot products run)
        "kernel_variant": isa.kernel_variant,  # the C build in use: generic, avx2, avx512 (PAGEDQ_CPU_ISA caps)
        "isa": isa.best,  # the best instruction set the probe ran, under the cap (amx, avx512_bf16...)
        "matmul": matmul if dtype == torch.float32 else f"{matmul}-bf16",
        "attention": "c" if cpu_attention.available() else "torch",
        "fused_ops": "c" if cpu_ops.available() else "torch",
    }
    if "avx512_bf16" in isa.probed:  # why auto took bf16 or not: the dot products' FLOP rate over fp32 FMAs'
        fields["bf16_dot_rate"] = cpu_isa.bf16_dot_rate()
    fast_matmul = matmul in ("panels", *cpu_linear.BF16_KINDS) or (dtype == torch.bfloat16 and matmul == "onednn")
    on_c = [fast_matmul, fields["attention"] == "c", fields["fused_ops"] == "c"]
    fields["path"] = "c" if all(on_c) else "torch" if not any(on_c) else "mixed"
    if all(on_c):
        return True, fields
    causes = {name: str(c_build.error(name)) for name in C_KERNELS if c_build.error(name)}
    if len(set(causes.values())) == 1 and len(causes) > 1:  # one cause (no compiler) said once
        causes = {", ".join(causes): next(iter(causes.values()))}
    errors = [f"{names}: {cause}" for names, cause in causes.items()]
    if os.environ.get("PAGEDQ_DISABLE_C_KERNELS"):
        errors.append("PAGEDQ_DISABLE_C_KERNELS is set")
    fields["reason"] = "; ".join(errors)[:500] or "switched off"
    return False, fields


def log_kernel_path(settings: Settings) -> None:
    """One ``worker.kernels`` line: info on the C (or CUDA) path, a warning with the cause on a fallback."""
    import structlog

    log = structlog.get_logger("pagedq.worker")
    fast, fields = kernel_path(settings)
    if fast:
        log.info("worker.kernels", **fields)
    else:
        log.warning(
            "worker.kernels",
            **fields,
            hint="CPU steps run on the slow torch fallback: install a C compiler (gcc) and restart",
        )


def stdout_gone() -> int:
    """Whoever read stdout left (``| head``): point stdout at /dev/null so the exit flush cannot raise again,
    and exit 141 (128 + SIGPIPE), what a C tool killed by that signal reports, instead of a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    print_config = args.pop("print_config")
    config = args.pop("config")
    try:
        settings = load_settings(config, **args)
    except SettingsError as exc:
        print(f"pagedq worker: {exc}", file=sys.stderr)
        return 2
    if print_config:
        try:
            print(json.dumps(settings.redacted(), indent=2, default=str))
            sys.stdout.flush()
        except BrokenPipeError:
            return stdout_gone()
        return 0
    from worker.run import configure_logging, run_worker

    configure_logging(settings)
    if settings.engine_factory is None:  # a factory brings its own engine (and kernels)
        try:
            log_kernel_path(settings)
        except KeyboardInterrupt:  # Ctrl-C while the kernels build: an answer, not a traceback
            print("pagedq worker: interrupted while starting", file=sys.stderr)
            return 130
    return run_worker(settings)


if __name__ == "__main__":
    sys.exit(main())
