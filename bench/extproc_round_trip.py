"""Can extproc skip the request-headers message? Envoy with poolgate's ext_proc filter, headers SEND (today)
against headers SKIP with the headers sent as ``request_attributes`` on the body message (one round trip).

Two static upstreams answer their own name: ``fallback`` is the default route's cluster, ``chosen`` the one
the ext_proc answer names (cluster header + ``clear_route_cache`` in the body answer, as extproc routes).
A minimal in-process ext_proc server answers. For each mode the run reports where requests went, whether
the body message carried the headers, how many messages Envoy sent per request, and the median latency.

Measured (Envoy 1.40): with headers SKIP the filter lets the headers go on at once, so the router picks
the route, cluster and host before the body message is even sent; the body answer's cluster header and
pin come too late and every request goes to the default route. The attributes do not carry the headers
either: ``request.headers`` arrives as the string "CelMap value" and ``request.headers['authorization']``
is left out (path, method and request id do arrive). Routing needs the headers held, so the headers
message stays (``docs/architecture.md``, "One round trip?").

    .venv/bin/python bench/extproc_round_trip.py [--requests 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import yaml
from aiohttp import web
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ProcessingResponse,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import host_quiet
from bench.harness import ProcessGroup
from bench.report import write_report
from controller.xds.bootstrap import render_bootstrap
from poolgate.kernel.config import parse_config
from poolgate.kernel.routing import CLUSTER_HEADER
from poolgate.procs import envoy_binary, free_port, wait_port

ATTRIBUTES = ["request.url_path", "request.method", "request.id", "request.headers['authorization']",
              "request.headers"]
"""What a body-first extproc would need: path, method, request id and the tenant's key."""
AUTHORIZATION = "request.headers['authorization']"
FILTER_NAME = "envoy.filters.http.ext_proc"
MODES = ("send", "skip")


class Processor(ext_proc_grpc.ExternalProcessorServicer):
    """Routes every request with a body to ``chosen`` from its body answer; counts what it was sent."""

    def __init__(self) -> None:
        self.messages = 0
        self.streams = 0
        self.headers_in_attributes = 0
        self.header_map = ""
        """How ``request.headers`` (the whole map) arrived: ``string_value`` is Envoy's "CelMap value"."""

    async def Process(self, request_iterator: Any, context: Any) -> Any:
        self.streams += 1
        async for message in request_iterator:
            self.messages += 1
            kind = message.WhichOneof("request")
            attributes = message.attributes.get(FILTER_NAME)
            if attributes is not None and attributes.fields[AUTHORIZATION].string_value == "Bearer key":
                self.headers_in_attributes += 1
                self.header_map = attributes.fields["request.headers"].WhichOneof("kind") or ""
            if kind == "request_headers":
                yield ProcessingResponse(request_headers=HeadersResponse())
            elif kind == "request_body":
                pick = HeaderValueOption(header=HeaderValue(key=CLUSTER_HEADER, raw_value=b"chosen"))
                common = CommonResponse(header_mutation=HeaderMutation(set_headers=[pick]), clear_route_cache=True)
                yield ProcessingResponse(request_body=BodyResponse(response=common))
            else:
                yield ProcessingResponse()


async def upstream(name: str) -> tuple[web.AppRunner, int]:
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text=name)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


def bootstrap(mode: str, extproc_port: int, upstreams: dict[str, int]) -> dict[str, Any]:
    """poolgate's bootstrap with static upstream clusters instead of ADS; ``skip``: headers SKIP + attributes."""
    config = parse_config({"pools": [{"name": "bench", "model": "m"}]})
    rendered = render_bootstrap(config, node_id=f"round-trip-{mode}", listen_port=free_port(),
                                admin_port=free_port(), extproc_port=extproc_port, xds_port=free_port())
    hcm = rendered["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == FILTER_NAME)["typed_config"]
    if mode == "skip":
        ext_proc["processing_mode"]["request_header_mode"] = "SKIP"
        ext_proc["request_attributes"] = ATTRIBUTES
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    routes[-1]["route"]["cluster"] = "fallback"
    for name, port in upstreams.items():
        rendered["static_resources"]["clusters"].append({
            "name": name, "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}})
    del rendered["dynamic_resources"]
    return rendered


async def measure(mode: str, requests: int, run_dir: Path, upstreams: dict[str, int]) -> dict[str, Any]:
    processor = Processor()
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    extproc_port = free_port()
    server.add_insecure_port(f"127.0.0.1:{extproc_port}")
    await server.start()
    config = bootstrap(mode, extproc_port, upstreams)
    path = run_dir / f"envoy-{mode}.yaml"
    path.write_text(yaml.safe_dump(config))
    listen = config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    group = ProcessGroup(run_dir)
    group.start(f"envoy-{mode}", [str(envoy_binary()), "-c", str(path), "-l", "error", "--use-dynamic-base-id",
                                  "--disable-hot-restart", "--concurrency", "1"])
    try:
        await wait_port("127.0.0.1", listen, 30)
        url = f"http://127.0.0.1:{listen}/v1/chat/completions"
        reached: dict[str, int] = {}
        latencies = []
        async with httpx.AsyncClient(timeout=10) as http:
            for index in range(requests + 10):
                started = time.perf_counter()
                response = await http.post(url, content=b'{"model": "m", "messages": []}',
                                           headers={"authorization": "Bearer key", "content-type": "application/json"})
                if index >= 10:  # warm-up
                    latencies.append(1000 * (time.perf_counter() - started))
                    reached[response.text] = reached.get(response.text, 0) + 1
        streams = max(1, processor.streams)
        return {"mode": mode, "requests": requests, "reached": reached,
                "routed_share": reached.get("chosen", 0) / requests,
                "messages_per_request": processor.messages / streams,
                "headers_in_body_message": processor.headers_in_attributes / streams,
                "header_map_as": processor.header_map,
                "p50_ms": statistics.median(latencies)}
    finally:
        group.stop_all()
        await server.stop(0)


async def run(requests: int) -> dict[str, Any]:
    runners = {}
    ports = {}
    for name in ("fallback", "chosen"):
        runners[name], ports[name] = await upstream(name)
    try:
        run_dir = Path(tempfile.mkdtemp(prefix="poolgate-round-trip-"))
        rows = [await measure(mode, requests, run_dir, ports) for mode in MODES]
    finally:
        for runner in runners.values():
            await runner.cleanup()
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args(argv)
    with host_quiet.measure() as quiet:
        report = asyncio.run(run(args.requests))
    print(f"{'headers':>8} {'to chosen':>9} {'msgs/req':>8} {'hdrs in body msg':>16} {'p50 ms':>7}  reached")
    for row in report["rows"]:
        print(f"{row['mode']:>8} {row['routed_share']:>9.0%} {row['messages_per_request']:>8.2f} "
              f"{row['headers_in_body_message']:>16.2f} {row['p50_ms']:>7.2f}  {row['reached']}")
    write_report("extproc_round_trip", report, host=quiet.stop())
    return 0


if __name__ == "__main__":
    sys.exit(main())
