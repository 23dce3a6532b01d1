"""Process entry point of a worker: logging, Redis (given or embedded), engine, signals, the loop.

``run_worker(settings)`` is what ``pagedq worker`` calls; it returns the process exit code.
"""

from __future__ import annotations

import faulthandler
import importlib
import logging
import signal
import sys
from types import FrameType
from typing import Any

import structlog

from schemas.keys import Keys
from worker.consumer import EngineLike, Worker
from worker.embedded_redis import EmbeddedRedis
from worker.health import HealthServer, start_health_server
from worker.redis_link import NotAClusterError, check_cluster
from worker.settings import Settings
from worker.watchdog import CHECK_EVERY_S, NO_STDERR_DESCRIPTOR, Watchdog

log = structlog.get_logger("pagedq.worker")


def configure_logging(settings: Settings) -> None:
    """structlog to stderr: JSON lines when not on a terminal (or when asked), readable on one."""
    level = getattr(logging, settings.log_level.upper())
    as_json = settings.log_format == "json" or (settings.log_format == "auto" and not sys.stderr.isatty())
    renderer: Any = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def build_engine(settings: Settings) -> EngineLike:
    """pagedq's engine from the settings, or ``engine_factory(settings)`` when that is set."""
    if settings.engine_factory:
        module, _, attr = settings.engine_factory.partition(":")
        factory: Any = importlib.import_module(module)
        for part in attr.split("."):
            factory = getattr(factory, part)
        engine: EngineLike = factory(settings)
        return engine
    import torch

    from engine import Engine, EngineConfig
    from engine.default_model import resolve_model_path

    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return Engine(
        EngineConfig(
            model=str(resolve_model_path(settings.model)),
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            kv_cache_bytes=settings.kv_cache_bytes,
            block_size=settings.block_size,
            enable_prefix_caching=settings.enable_prefix_caching,
            num_speculative_tokens=settings.num_speculative_tokens,
            prompt_lookup_min=settings.prompt_lookup_min,
            prompt_lookup_max=settings.prompt_lookup_max,
            speculative_disable_by_batch_size=settings.speculative_disable_by_batch_size,
            max_model_len=settings.max_model_len,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            tensor_parallel_size=settings.tensor_parallel_size,
            distributed_timeout_s=settings.distributed_timeout_s,
            dtype=settings.dtype,
            device=device,
            quantization=settings.quantization,
        )
    )


EXIT_METRICS_PORT_UNAVAILABLE = 78  # EX_CONFIG (as a name in use): a setting is at fault, nothing was loaded
EXIT_MODEL_UNAVAILABLE = 78  # the same for --model: no folder, an incomplete one, the default model not installable
EXIT_CONFIG = 78  # the same for --device (no such CUDA device) and --data-dir (no folder the embedded Redis can use)


def _device_problem(settings: Settings) -> str | None:
    """Why ``--device`` names no device here (``cuda`` on a host without a visible GPU, ``cuda:N`` past the
    last one), found before the model loads: the engine raised it from deep inside torch, as a traceback."""
    if settings.engine_factory or not settings.device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return (
            f"device {settings.device}: no CUDA device is visible (torch {torch.__version__}, {built}); "
            "use --device cpu or auto (PAGEDQ_DEVICE), or give the container a GPU"
        )
    index = int(settings.device.partition(":")[2] or 0)
    if index >= (count := torch.cuda.device_count()):
        return f"device {settings.device}: only {count} CUDA device(s) are visible (cuda:0 .. cuda:{count - 1})"
    return None


def _model_problem(settings: Settings) -> str | None:
    """Why ``--model`` names nothing loadable, found before torch loads (engine/checkpoint.py): one log line
    saying what to pass, not a traceback; a supervisor restarting the worker would only meet it again."""
    if settings.engine_factory:
        return None
    from engine.default_model import DefaultModelUnavailable, resolve_model_path

    try:
        resolve_model_path(settings.model)
    except (FileNotFoundError, ValueError, DefaultModelUnavailable) as exc:
        return str(exc)
    return None


def _is_model_error(exc: ValueError) -> bool:
    """Whether the engine refused the model itself, after :func:`_model_problem` passed it (that check reads
    headers only): a GGUF whose rope scaling pagedq does not run, weights that do not match the config, an
    unsupported architecture. The same ``worker.model_unavailable`` line and exit 78 as the check's; it was
    a traceback and exit 1, which a supervisor restarts forever. Other ValueErrors stay ``worker.failed``."""
    from engine.checkpoint import GGUFError
    from engine.loader import CheckpointMismatchError
    from engine.model_config import UnsupportedModelError

    return isinstance(exc, GGUFError | CheckpointMismatchError | UnsupportedModelError)


class _StopWhileStarting(BaseException):
    """SIGTERM or SIGINT before the loop runs (the kernels build, the model loads): nothing is held yet."""


def _stop_while_starting(signum: int, _frame: FrameType | None) -> None:
    raise _StopWhileStarting(signum)


def _register_stack_dump() -> bool:
    """`kill -USR1 <pid>` writes every thread's Python stack to stderr and the worker goes on: where a slow load
    or a stuck step is. faulthandler answers from C, so it works while the loop's thread sits inside a kernel or
    a collective, where a Python handler would wait for it to come back. False where stderr cannot take it
    (:data:`~worker.watchdog.NO_STDERR_DESCRIPTOR`): no dump then."""
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    except NO_STDERR_DESCRIPTOR:
        return False
    return True


def run_worker(settings: Settings) -> int:
    """Run a worker until SIGTERM/SIGINT (graceful drain; a second signal stops at once). Exit code."""
    configure_logging(settings)
    log.info("worker.config", **settings.redacted())
    embedded: EmbeddedRedis | None = None
    url = settings.redis_url
    if not url:
        embedded = EmbeddedRedis(settings.data_dir)
        try:
            url = embedded.start()
        except (OSError, RuntimeError) as exc:  # a folder it cannot write; a redis-server that will not start
            log.error(
                "worker.embedded_redis_failed",
                data_dir=str(settings.data_dir),
                error=str(exc),
                hint="give --data-dir (PAGEDQ_DATA_DIR) a folder this user can write, or --redis-url a Redis",
            )
            return EXIT_CONFIG if isinstance(exc, OSError) else 1
        log.info("worker.embedded_redis", url=url, data_dir=str(settings.data_dir), hint="point producers here")
    health: HealthServer | None = None
    # Until the loop has its handler, a stop ends the start at once and cleanly: the default SIGTERM killed
    # the process without a word, leaving the embedded Redis (its own session) running; Ctrl-C printed a
    # KeyboardInterrupt traceback.
    starting = {sig: signal.signal(sig, _stop_while_starting) for sig in (signal.SIGTERM, signal.SIGINT)}
    stacks_on_sigusr1 = _register_stack_dump()
    engine: EngineLike | None = None
    try:
        if settings.metrics_port:  # before the model loads: /healthz answers, /readyz says "loading"
            keys = Keys(settings.namespace, settings.queue, settings.queue_shards)
            try:
                health = start_health_server(settings.metrics_host, settings.metrics_port, url, keys)
            except OSError as exc:  # taken (a second worker on the host with the same port) or not ours to bind
                log.error(
                    "worker.metrics_port_unavailable",
                    host=settings.metrics_host,
                    port=settings.metrics_port,
                    error=str(exc),
                    hint="give each worker on a host its own --metrics-port (PAGEDQ_METRICS_PORT), or 0 for none",
                )
                return EXIT_METRICS_PORT_UNAVAILABLE
            log.info("worker.metrics", host=settings.metrics_host, port=health.port)
        check_cluster(url, settings.block_s)  # before the model loads (NotAClusterError: below)
        if (problem := _model_problem(settings)) is not None:
            log.error("worker.model_unavailable", model=settings.model, error=problem)
            return EXIT_MODEL_UNAVAILABLE
        if (problem := _device_problem(settings)) is not None:
            log.error("worker.device_unavailable", device=settings.device, error=problem)
            return EXIT_CONFIG
        try:
            engine = build_engine(settings)
        except ValueError as exc:
            if not _is_model_error(exc):
                raise
            log.error("worker.model_unavailable", model=settings.model, error=str(exc))
            return EXIT_MODEL_UNAVAILABLE
        worker = Worker(settings, engine, url)
        if health is not None:
            worker.ledger.metrics = health.metrics
            dtype = getattr(getattr(engine, "config", None), "torch_dtype", settings.dtype)  # "auto" resolved
            health.metrics.set_model(worker.model_name, dtype)
            health.attach(lambda: worker.status, worker.liveness)
        watchdog = Watchdog(
            worker, shutdown_grace_s=settings.shutdown_grace_s, stall_timeout_s=settings.stall_timeout_s, log=log
        )
        watchdog.start()

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            log.info("worker.signal", signal=signal.Signals(signum).name)
            worker.request_stop()

        for sig in starting:
            signal.signal(sig, on_signal)
        try:
            return worker.run()
        finally:
            watchdog.stop()
            watchdog.join(timeout=2 * CHECK_EVERY_S)  # not left running while the interpreter shuts down
    except NotAClusterError as exc:  # at check_cluster, or once the model loaded (the cluster was down before)
        log.error("worker.redis_not_a_cluster", error=str(exc))
        return EXIT_CONFIG
    except _StopWhileStarting as stop:
        log.info("worker.stopped", signal=signal.Signals(stop.args[0]).name, phase="starting")
        return 0
    except Exception:
        log.exception("worker.failed")
        return 1
    finally:
        for sig, handler in starting.items():
            signal.signal(sig, handler)
        close = getattr(engine, "close", None)
        if close is not None:  # tensor parallelism: stop the rank processes (a stop while starting too)
            close()
        if health is not None:
            health.stop()
        if embedded is not None:
            embedded.stop()
        if stacks_on_sigusr1:  # last: a stop that hangs (a rank's join, a collective's teardown) still answers
            faulthandler.unregister(signal.SIGUSR1)
