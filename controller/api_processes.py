"""The registry API served by several processes on one port, for fleets whose heartbeats outgrow one core.

With ``controller.api_processes`` N > 1 the controller holds its API port (bound with ``SO_REUSEPORT``, not
listened on) and starts N API processes listening on it; the kernel spreads the connections over them. The
controller itself then answers no worker: its loop is left to the health monitor and xDS, so a fleet's
heartbeats never delay an endpoint change (at 10,000 workers they had put a second on its p99). An API
process is a ``RegistryApi`` over its own Redis connections behind a lean HTTP server (``controller.lean_front``):
it answers the workers' calls itself (heartbeats and registrations, putting registrations off by its own loop's
lag) and forwards every other call (listing, deregistration, drain, scale, ``/metrics``) to the controller's
private loopback listener. The controller starts an API process again when it exits; an API process whose
controller is gone exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import Sequence

import aiohttp
import uvloop

from controller.lean_front import LeanFront
from controller.overload import LoopLag
from controller.registry_api import RegistryApi, error_answer
from poolgate.kernel.cancel import cancel_and_wait
from poolgate.kernel.config import ConfigError, load_process_config
from poolgate.kernel.heap import freeze_startup_objects
from poolgate.kernel.logging_setup import add_log_format_argument, configure_logging
from poolgate.kernel.shutdown import on_stop_signal
from poolgate.kernel.store import FleetStore, connect
from poolgate.kernel.tls import ServerTls

log = logging.getLogger("poolgate.controller.api_processes")

RESTART_DELAY_S = 1.0
"""An API process that exited is started again after this long (a crash loop costs one start a second)."""
STOP_GRACE_S = 5.0
"""API processes get this long to finish their calls on a stop before they are killed."""
ANSWER_GRACE_S = 2.0
"""A stopping API process answers the calls under way for this long at most (a drain passed on with
``?wait=1`` may last much longer), well inside ``STOP_GRACE_S``."""
PARENT_CHECK_S = 1.0
"""An API process looks this often whether its controller still runs."""
REDIS_URL_ENV = "POOLGATE_API_PROCESS_REDIS_URL"
"""Where an API process finds the controller's Redis URL."""
FORWARDED_HEADERS = ("Authorization", "Content-Type")
ANSWERED_HEADERS = ("Content-Type", "Retry-After")


class Forwarder:
    """Passes a call on to the controller's own API and answers with what it answered (``lean_front.PassOn``)."""

    def __init__(self, base_url: str) -> None:
        self._base_url = base_url
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, method: bytes, target: bytes, headers: dict[bytes, bytes],
                       body: bytes) -> tuple[int, dict[str, str], bytes]:
        if self._session is None:  # made on the loop that serves: a session belongs to one loop
            # no total timeout: a drain with ?wait=1 answers once the drain is over
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        passed = {name: headers[name.lower().encode()].decode("latin-1") for name in FORWARDED_HEADERS
                  if name.lower().encode() in headers}
        try:
            async with self._session.request(method.decode("latin-1"), self._base_url + target.decode("latin-1"),
                                             data=body, headers=passed) as answer:
                kept = {name: answer.headers[name] for name in ANSWERED_HEADERS if name in answer.headers}
                return answer.status, kept, await answer.read()
        except aiohttp.ClientError as exc:
            refusal = error_answer(503, f"the controller behind this API process does not answer ({exc})",
                                   "controller_unreachable")
            return refusal.status, {}, refusal.body

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class ApiProcesses:
    """The controller's API processes: started with ``command`` (each gets the same one), started again when
    one exits, stopped with the controller."""

    def __init__(self, count: int, command: Sequence[str], redis_url: str) -> None:
        self._count = count
        self._command = tuple(command)
        self._env = {**os.environ, REDIS_URL_ENV: redis_url}
        """The Redis URL goes in the environment, not the command line, which any local user can read."""
        self._running: list[asyncio.subprocess.Process] = []

    async def run(self, stop: asyncio.Event) -> None:
        """Keep ``count`` processes running until ``stop``; then stop them."""
        slots = [asyncio.create_task(self._keep_one(index, stop)) for index in range(self._count)]
        try:
            await stop.wait()
        finally:
            for slot in slots:
                slot.cancel()
            await asyncio.gather(*slots, return_exceptions=True)
            await self._stop_all()

    async def _keep_one(self, index: int, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                process = await asyncio.create_subprocess_exec(*self._command, env=self._env)
            except OSError as exc:
                log.warning("cannot start API process %d (%s); trying again", index, exc)
                await asyncio.sleep(RESTART_DELAY_S)
                continue
            self._running.append(process)
            code = await process.wait()
            self._running.remove(process)
            if stop.is_set():
                return
            log.warning("API process %d (pid %d) exited with %s; starting it again", index, process.pid, code)
            await asyncio.sleep(RESTART_DELAY_S)

    async def _stop_all(self) -> None:
        running = [p for p in self._running if p.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        waits = [asyncio.ensure_future(p.wait()) for p in running]
        if not waits:
            return
        _, late = await asyncio.wait(waits, timeout=STOP_GRACE_S)
        for process in running:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
        await asyncio.gather(*late, return_exceptions=True)


def command(config_path: str, log_format: str, host: str, port: int, forward_url: str) -> list[str]:
    """How the controller starts one API process."""
    return [sys.executable, "-m", "controller.api_processes", "--config", config_path, "--log-format", log_format,
            "--host", host, "--port", str(port), "--forward", forward_url]


async def _watch_parent(parent: int, stop: asyncio.Event) -> None:
    """Stop once the controller that started this process is gone (it was killed, so it could not stop us)."""
    while not stop.is_set():
        if os.getppid() != parent:
            log.warning("the controller (pid %d) is gone; this API process stops", parent)
            stop.set()
            return
        await asyncio.sleep(PARENT_CHECK_S)


async def serve(args: argparse.Namespace, parent: int) -> None:
    config, redis_url = load_process_config(args.config, os.environ.get(REDIS_URL_ENV), "controller API process")
    token = config.controller.resolved_token()
    if not token:
        raise ConfigError(f"no token (set {config.controller.token_env} or controller.token)")
    redis = connect(redis_url)
    lag = LoopLag()
    forward = Forwarder(args.forward)
    registry = RegistryApi(FleetStore(redis, config.key_prefix), token, config.pools, config.controller,
                           config.autoscale.pools, lag=lag)
    api_tls = ServerTls(config.tls.registry_api, "tls.registry_api") if config.tls.registry_api else None
    connections: set[LeanFront] = set()

    def connection() -> LeanFront:
        front = LeanFront(registry, forward, connections.discard)
        connections.add(front)
        return front

    server = await asyncio.get_running_loop().create_server(
        connection, args.host, args.port, ssl=api_tls.context if api_tls else None, reuse_port=True)
    log.info("API process %d serving on %s:%d", os.getpid(), args.host, args.port)
    freeze_startup_objects()
    stop = asyncio.Event()
    on_stop_signal(asyncio.get_running_loop(), stop.set, STOP_GRACE_S)
    tasks = [asyncio.create_task(lag.run()), asyncio.create_task(_watch_parent(parent, stop)),
             asyncio.create_task(registry.say_it_serves(stop))]
    if api_tls is not None:
        tasks.append(asyncio.create_task(api_tls.watch(config.tls.reload_s, stop)))
    try:
        await stop.wait()
    finally:
        await cancel_and_wait(tasks)
        server.close()
        for _ in range(int(ANSWER_GRACE_S / 0.05)):  # calls under way are answered; then every connection closes
            if not any(front.busy for front in connections):
                break
            await asyncio.sleep(0.05)
        for front in list(connections):
            front.close()
        await forward.close()
        await redis.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one of the controller's registry API processes")
    parser.add_argument("--config", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--forward", required=True, help="the controller's own API, for the operator's calls")
    add_log_format_argument(parser)
    args = parser.parse_args(argv)
    configure_logging(logging.INFO, args.log_format)
    try:
        uvloop.run(serve(args, os.getppid()))
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
