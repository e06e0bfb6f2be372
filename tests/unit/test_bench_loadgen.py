"""The benchmarks' client against a fake worker with known timings: TTFT at the first generated token,
refusals and timeouts as misses at +∞, TPOT, goodput and the CDF's share of all sent requests.

The fake worker is a small aiohttp server in the test (it stands in for an inference server; the
measuring code is what is under test). Its timings are lower bounds the client cannot beat; the upper
bounds are generous because the host is shared.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from bench.loadgen import Counters, SseTally, Target, new_session, run_open_loop
from bench.measure import client_figures
from bench.report import plot_ttft_cdf
from bench.workload import CHAT_PATH, RequestSpec
from poolgate.procs import free_port

FIRST_TOKEN_S = 0.3
TOKEN_GAP_S = 0.05
TOKENS = 5


def event(payload: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def chunk(content: str, role: bool = False) -> bytes:
    delta: dict[str, object] = {"role": "assistant", "content": content} if role else {"content": content}
    return event({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    behaviour = body["model"]
    if behaviour == "refuse":
        return web.json_response({"error": {"message": "busy", "code": 429}}, status=429)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(chunk("", role=True))  # the role chunk comes early: it must not count as TTFT
    await asyncio.sleep(FIRST_TOKEN_S if behaviour == "fast" else 4.0)  # "hang": past the drain
    for index in range(TOKENS):
        data = chunk(f" w{index}")
        await response.write(data[:7])  # an event split across network chunks is still one event
        await response.write(data[7:])
        await asyncio.sleep(TOKEN_GAP_S)
    await response.write(event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": TOKENS}}))
    await response.write(b"data: [DONE]\n\n")
    return response


@pytest.fixture
async def fake_worker() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post(CHAT_PATH, chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def spec(index: int, arrival_s: float, slo_s: float = 1.0) -> RequestSpec:
    return RequestSpec(index=index, arrival_s=arrival_s, workload="chat", role="chat", path=CHAT_PATH,
                       prompt_tokens=3, max_tokens=None, nominal_stream=True, slo_ttft_s=slo_s, text_seed=0)


async def test_known_timings_give_known_figures(fake_worker: str) -> None:
    behaviours = ["fast"] * 6 + ["refuse", "hang"]
    trace = [spec(i, 0.05 * i) for i in range(len(behaviours))]
    bodies = [orjson.dumps({"model": b, "messages": [], "stream": True}) for b in behaviours]
    counters = Counters()
    async with new_session() as session:
        outcomes = await run_open_loop(session, Target.single("fake", fake_worker), trace, bodies, time_scale=1.0,
                                       window_s=0.6, drain_s=1.5, counters=counters)
    assert len(outcomes) == len(trace)
    fast = outcomes[:6]
    for outcome in fast:
        assert outcome.completed and outcome.error is None
        assert outcome.tokens == TOKENS and outcome.usage_tokens == TOKENS
        assert outcome.ttft_s is not None and FIRST_TOKEN_S <= outcome.ttft_s < FIRST_TOKEN_S + 0.6
    refused, hung = outcomes[6], outcomes[7]
    assert refused.refused and refused.status == 429 and refused.ttft_s is None
    assert hung.cut and hung.ttft_s is None

    figures = client_figures(outcomes, time_scale=2.0, class_names=["chat"])  # model time = 2 × wall
    assert figures["sent"] == 8 and figures["completed"] == 6
    assert figures["refused"] == 1 and figures["errors"] == 0 and figures["timed_out"] == 1
    assert 2 * FIRST_TOKEN_S <= figures["ttft_p50_s"] < 2 * (FIRST_TOKEN_S + 0.6)
    assert math.isinf(figures["ttft_p99_s"])  # the refused and the hung request are misses at +∞
    assert 2 * TOKEN_GAP_S * 0.9 <= figures["tpot_p50_s"] < 2 * (TOKEN_GAP_S + 0.3)
    assert figures["goodput_ratio"] == pytest.approx(6 / 8)  # 0.6-0.9 s TTFT (model) is inside the 1 s SLO
    assert figures["goodput_by_class"] == {"chat": pytest.approx(6 / 8)}
    assert len(figures["ttft_samples_s"]) == 6 and figures["output_tokens"] == 6 * TOKENS
    assert counters.sent == 8 and counters.first_tokens == 6

    tight = client_figures(outcomes, time_scale=10.0, class_names=["chat"])  # 3 s model TTFT misses the SLO
    assert tight["goodput_ratio"] == 0.0


class Axis:
    def __init__(self) -> None:
        self.lines: list[tuple[list[float], list[float]]] = []

    def plot(self, xs: list[float], ys: list[float], label: str) -> None:
        self.lines.append((xs, ys))


def test_cdf_is_a_share_of_every_request_sent() -> None:
    axis = Axis()
    plot_ttft_cdf(axis, [0.1, 0.2, 0.4], sent=4, label="r")
    assert axis.lines == [([0.1, 0.2, 0.4], [0.25, 0.5, 0.75])]  # the refused fourth keeps it below 1


def test_sse_tally_counts_text_events_only() -> None:
    tally = SseTally()
    stream = (chunk("", role=True) + chunk(" a") + b"data: {\"choices\":[{\"text\":\"x\"}]}\r\n\r\n"
              + event({"choices": [], "usage": {"completion_tokens": 2}}) + b"data: [DONE]\n\n")
    counts = [tally.feed(stream[i:i + 9]) for i in range(0, len(stream), 9)]
    assert sum(counts) == 2 and tally.tokens == 2
    assert tally.done and not tally.error and tally.usage_tokens == 2
    broken = SseTally()
    broken.feed(event({"error": {"message": "engine failed", "code": 500}}))
    assert broken.error and broken.tokens == 0
