"""Operator commands' client for the controller API: finds the leader and sends one authenticated call.

The controller API address comes from ``--controller`` or from what the leader announced in Redis
(``{prefix}:controller``); the token from ``--token`` or the config's token setting/environment.
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
from typing import Any

import aiohttp
import orjson

from poolgate.kernel.config import ConfigError, load_config
from poolgate.kernel.errors import PoolgateError
from poolgate.kernel.outage import REDIS_ERRORS
from poolgate.kernel.redaction import redact_url
from poolgate.kernel.store import FleetStore, connect
from poolgate.kernel.tls import client_context
from poolgate.status import redis_url_argument


class CommandError(PoolgateError):
    """The operator command cannot be carried out; the message says what to do."""


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="deploy/local.yaml", help="poolgate YAML config (token, key prefix)")
    parser.add_argument("--controller", help="controller API URL (default: the leader announced in Redis)")
    parser.add_argument("--redis-url", type=redis_url_argument,
                        help="Redis to find the leader in (default: the config's)")
    parser.add_argument("--token", help="controller token (default: the config's token or its environment)")


async def _resolve(args: argparse.Namespace) -> tuple[str, str, ssl.SSLContext | None]:
    try:
        config = load_config(args.config)
        tls = client_context(config.tls.operator)
    except ConfigError as exc:
        raise CommandError(str(exc)) from exc
    except (OSError, ssl.SSLError) as exc:
        raise CommandError(f"tls.operator: cannot load the certificate files: {exc}") from exc
    token = args.token or config.controller.resolved_token()
    if not token:
        raise CommandError(f"no controller token: pass --token or set {config.controller.token_env}")
    if args.controller:
        return args.controller.rstrip("/"), token, tls
    redis_url = args.redis_url or config.redis_url
    if not redis_url:
        raise CommandError("give --controller URL, or --redis-url so the leader's address can be looked up")
    client = connect(redis_url, max_connections=None, socket_connect_timeout=2)
    try:
        url = await FleetStore(client, config.key_prefix).controller_url()
    except REDIS_ERRORS as exc:
        raise CommandError(f"Redis at {redact_url(redis_url)} is not reachable: {exc}") from exc
    finally:
        await client.aclose()
    if not url:
        raise CommandError("no controller has announced its API in Redis; give --controller URL")
    return url, token, tls


async def call(args: argparse.Namespace, path: str, body: dict[str, Any] | None = None,
               timeout_s: float = 30.0) -> tuple[int, dict[str, Any]]:
    """POST ``path`` to the controller; (status, JSON body)."""
    base, token, tls = await _resolve(args)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout, headers={"Authorization": f"Bearer {token}"},
                                         connector=aiohttp.TCPConnector(ssl=tls or True)) as http:
            async with http.post(f"{base}{path}", data=orjson.dumps(body or {}),
                                 headers={"content-type": "application/json"}) as response:
                raw = await response.read()
                return response.status, orjson.loads(raw) if raw else {}
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
        raise CommandError(f"controller at {base} did not answer: {exc or type(exc).__name__}") from exc


def run(coro: Any) -> int:
    try:
        return int(asyncio.run(coro))
    except CommandError as exc:
        print(f"poolgate: {exc}")
        return 2
