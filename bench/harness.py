"""Benchmark plumbing: child processes that always get stopped, a fixed-reply upstream, CPU time per pid,
metric scrapes of simulated workers, a one-token chat probe of a router.

``python bench/harness.py upstream PORT`` runs the upstream: an OpenAI-shaped chat completion answered at
once (or, for a body starting with ``{"stream":true``, ``STREAM_CHUNKS`` paced SSE chunks), so a benchmark
of the routing path measures the router and not a model.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from poolgate.kernel.child_process import own_group_dying_with_parent

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(stat_path: Path) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold spaces)."""
    return stat_path.read_text().rsplit(")", 1)[1].split()


def _cpu_of(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    return _cpu_of(_stat_fields(Path(f"/proc/{pid}/stat")))


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole host from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [float(x) for x in stat.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


def tree_cpu_seconds(root_pid: int) -> float:
    """CPU seconds (user + system) used so far by ``root_pid`` and every live descendant (Linux /proc)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields(entry / "stat")
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = _cpu_of(fields)
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(times.get(pid, 0.0) for pid in tree)


async def scrape(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """A worker's metric samples by name, summed over label sets (histogram buckets keyed ``name|le``)."""
    async with session.get(base_url + "/metrics") as response:
        text = await response.text()
    samples: dict[str, float] = {}
    for sample in _samples(text):
        key = f"{sample.name}|{sample.labels['le']}" if "le" in sample.labels else sample.name
        samples[key] = samples.get(key, 0.0) + sample.value
    return samples


async def scrape_labelled(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """A process's metric samples keyed ``name{label="value",…}`` (labels sorted), for a gauge by state."""
    async with session.get(base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as response:
        text = await response.text()
    samples: dict[str, float] = {}
    for sample in _samples(text):
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
        samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def _samples(text: str) -> Iterator[Sample]:
    for family in text_string_to_metric_families(text):
        yield from family.samples


async def answers_chat(session: aiohttp.ClientSession, base_url: str, model: str,
                       headers: Mapping[str, str] | None = None) -> int | None:
    """The status of a one-token chat completion (``ping``) at ``base_url``; None when nothing answered."""
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    try:
        async with session.post(base_url + "/v1/chat/completions", json=body, headers=dict(headers or {}),
                                timeout=aiohttp.ClientTimeout(total=5)) as response:
            await response.read()
            return response.status
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None


def lag_quantile(before: Mapping[str, float], after: Mapping[str, float], share: float,
                 histogram: str = "poolgate_sim_step_lag_seconds") -> float:
    """A quantile of a histogram between two scrapes (linear within a bucket); by default the simulator's
    step lag."""
    prefix = f"{histogram}_bucket|"
    buckets = sorted((float(key[len(prefix):]), after[key] - before.get(key, 0.0))
                     for key in after if key.startswith(prefix))
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    total = buckets[-1][1]
    lower, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= share * total:
            if math.isinf(bound):
                return lower
            return lower + (share * total - lower_count) / max(count - lower_count, 1e-9) * (bound - lower)
        lower, lower_count = bound, count
    return math.nan


class ProcessGroup:
    """Children started for one benchmark; each in its own session, all stopped (then killed) at the end, and
    each ended with the benchmark if it is killed first (a stopped benchmark leaves nothing running)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with (self.log_dir / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env={**os.environ, **(env or {})},
                                       preexec_fn=own_group_dying_with_parent)
        self.children[name] = process
        return process

    def stop_all(self, grace_s: float = 5.0) -> None:
        for process in reversed(list(self.children.values())):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.children.values():
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


STREAM_CHUNKS = 64
"""A request whose body starts with ``"stream": true`` is answered with this many SSE chunks."""
STREAM_CHUNK_GAP_S = 0.002
STREAM_CHUNK = (b'data: {"id":"cmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench-model",'
                b'"choices":[{"index":0,"delta":{"content":"ok"},"finish_reason":null}]}\n\n')


def run_upstream(port: int) -> None:
    import asyncio

    from aiohttp import web

    body = (b'{"id":"cmpl-bench","object":"chat.completion","created":0,"model":"bench-model","choices":'
            b'[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
            b'"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}')

    async def reply(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if not raw.startswith((b'{"stream":true', b'{"stream": true')):
            return web.Response(body=body, content_type="application/json",
                                headers={"x-poolgate-worker": "upstream-1"})
        response = web.StreamResponse(headers={"content-type": "text/event-stream",
                                               "x-poolgate-worker": "upstream-1"})
        await response.prepare(request)
        for _ in range(STREAM_CHUNKS):  # paced like tokens, so Envoy forwards each as its own body chunk
            await response.write(STREAM_CHUNK)
            await asyncio.sleep(STREAM_CHUNK_GAP_S)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def models(request: web.Request) -> web.Response:  # the controller's health probe asks for it
        return web.json_response({"object": "list", "data": [{"id": "bench-model", "object": "model"}]})

    app = web.Application(client_max_size=64 * 1024 * 1024)  # the body-size sweep sends up to 1 MB
    app.router.add_post("/v1/chat/completions", reply)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def run_observer(port: int) -> None:
    """An ext_proc server for a second filter in ``observability_mode``: it answers nothing (Envoy does not
    wait) and does per response what extproc's observers do (GenAI timing scan and usage scan per chunk,
    metrics recorded at the end), so its CPU is what moving those observers to such a filter would cost.
    The request is named by the ``request.id`` response attribute (what correlating with the routing
    stream would key on)."""
    import asyncio
    import time
    from typing import Any

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

    from extproc.genai import GenAiCall
    from extproc.metrics import Metrics
    from extproc.usage import UsageWatch

    metrics = Metrics()

    class Observer(ext_proc_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator: Any, context: Any) -> Any:
            call, usage, request_id = GenAiCall("/v1/chat/completions", time.perf_counter()), UsageWatch(True), ""
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "response_headers":
                    attributes = message.attributes.get("envoy.filters.http.ext_proc")
                    request_id = attributes.fields["request.id"].string_value if attributes else ""
                    call.stream = True
                    call.response_headers(200, message.response_headers.end_of_stream, time.perf_counter())
                elif kind == "response_body":
                    body = message.response_body
                    call.response_chunk(body.body, body.end_of_stream, time.perf_counter())
                    usage.feed(body.body, body.end_of_stream)
            if request_id:
                call.record(metrics, usage.input_tokens, usage.output_tokens, time.perf_counter())
            return
            yield  # an async generator that yields nothing: observability mode wants no answers

    async def serve() -> None:
        server = grpc.aio.server()
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(Observer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "upstream":
        run_upstream(int(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "observer":
        run_observer(int(sys.argv[2]))
    else:
        sys.exit("usage: harness.py upstream|observer PORT")
