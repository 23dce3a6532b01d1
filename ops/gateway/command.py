"""``pagedq serve``: flags built from :class:`GatewaySettings` (each also a ``PAGEDQ_*`` variable), then uvicorn.

Imports stay light (FastAPI, uvicorn, redis-py, pydantic): the gateway never loads torch, so it starts in
well under a second and a container of it needs no model.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ops.gateway.settings import GatewaySettings, load_gateway_settings
from worker.settings import ENV_PREFIX, SettingsError, default_data_dir, mask_url


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models), /healthz and the fleet "
        "dashboard (/dashboard) over the queue. Every flag is also a PAGEDQ_* environment variable; flags win."
    )
    parser.add_argument("--print-config", action="store_true", help="print the effective settings (keys masked)")
    for name, info in GatewaySettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = "" if info.default in (None, []) or info.default_factory else f"; default: {info.default}"
        help_text = f"{info.description or ''} (env {ENV_PREFIX}{name.upper()}{default})"
        parser.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_text)


def resolve_url(settings: GatewaySettings) -> str:
    """``redis_url``, else the socket of the embedded Redis a ``pagedq worker`` on this machine started."""
    if settings.redis_url:
        return settings.redis_url
    from worker.embedded_redis import EmbeddedRedis

    embedded = EmbeddedRedis(default_data_dir())
    if embedded.socket_path.exists():
        return embedded.url
    raise SettingsError(
        f"no Redis: pass --redis-url or set PAGEDQ_REDIS_URL (no embedded Redis socket at {embedded.socket_path})"
    )


def run(args: argparse.Namespace) -> int:
    given: dict[str, Any] = {k: v for k, v in vars(args).items() if k in GatewaySettings.model_fields}
    try:
        settings = load_gateway_settings(**given)
    except SettingsError as exc:
        print(f"pagedq serve: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(settings.redacted(), indent=2))
        return 0
    try:
        url = resolve_url(settings)
    except SettingsError as exc:
        print(f"pagedq serve: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from ops.gateway.app import create_app

    print(
        f"pagedq serve: http://{settings.host}:{settings.port} (Redis {mask_url(url)}, namespace {settings.namespace}"
        f", {'API keys required' if settings.api_keys else 'no API keys'})",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(create_app(settings, url), host=settings.host, port=settings.port, log_level=settings.log_level)
    return 0
