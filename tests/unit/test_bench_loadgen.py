"""The benchmarks' client against a fake worker with known timings: TTFT at the first generated token,
refusals and timeouts as misses at +∞, TPOT, goodput and the CDF's share of all sent requests.

The fake worker is a small aiohttp server in the test (it stands in for an inference server; the
measuring code is what is under test). Its timings are lower bounds the client cannot beat; the figures
are checked against the outcomes the client recorded (the percentiles' nearest rank, the time scale), and
the SLO and the drain leave seconds of room, so a loaded host delays the run without failing it.
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


SLO_S = 3.0
"""The requests' TTFT SLO in model seconds: 1.5 s of wall time at the time scale 2, five times the fake's
first-token delay."""
DRAIN_S = 3.0
RELEASE = web.AppKey("release", asyncio.Event)
"""Set when the test ends: the hanging request's handler returns."""


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    behaviour = body["model"]
    if behaviour == "refuse":
        return web.json_response({"error": {"message": "busy", "code": 429}}, status=429)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(chunk("", role=True))  # the role chunk comes early: it must not count as TTFT
    if behaviour == "hang":  # no token until the test ends: the run must cut it after its drain
        await request.app[RELEASE].wait()
        return response
    await asyncio.sleep(FIRST_TOKEN_S)
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
    app[RELEASE] = asyncio.Event()
    app.router.add_post(CHAT_PATH, chat)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    yield f"http://127.0.0.1:{port}"
    app[RELEASE].set()
    await runner.cleanup()


def spec(index: int, arrival_s: float, slo_s: float = SLO_S) -> RequestSpec:
    return RequestSpec(index=index, arrival_s=arrival_s, workload="chat", role="chat", path=CHAT_PATH,
                       prompt_tokens=3, max_tokens=None, nominal_stream=True, slo_ttft_s=slo_s, text_seed=0)


async def test_known_timings_give_known_figures(fake_worker: str) -> None:
    behaviours = ["fast"] * 6 + ["refuse", "hang"]
    trace = [spec(i, 0.05 * i) for i in range(len(behaviours))]
    bodies = [orjson.dumps({"model": b, "messages": [], "stream": True}) for b in behaviours]
    counters = Counters()
    async with new_session() as session:
        outcomes = await run_open_loop(session, Target.single("fake", fake_worker), trace, bodies, time_scale=1.0,
                                       window_s=0.6, drain_s=DRAIN_S, counters=counters)
    assert len(outcomes) == len(trace)
    fast = outcomes[:6]
    for outcome in fast:
        assert outcome.completed and outcome.error is None
        assert outcome.tokens == TOKENS and outcome.usage_tokens == TOKENS
        # At the first text event: after the worker's delay (not at the early role chunk), before the end.
        assert outcome.ttft_s is not None and outcome.e2e_s is not None
        assert FIRST_TOKEN_S <= outcome.ttft_s < outcome.e2e_s
        assert outcome.e2e_s >= FIRST_TOKEN_S + TOKENS * TOKEN_GAP_S
    refused, hung = outcomes[6], outcomes[7]
    assert refused.refused and refused.status == 429 and refused.ttft_s is None
    assert hung.cut and hung.ttft_s is None
    ttfts = sorted(o.ttft_s for o in fast if o.ttft_s is not None)
    tpots = sorted((o.e2e_s - o.ttft_s) / (TOKENS - 1) for o in fast if o.e2e_s is not None and o.ttft_s is not None)
    print(f"\nmeasured (wall): TTFT {ttfts[0]:.3f}-{ttfts[-1]:.3f} s, TPOT {tpots[0]:.3f}-{tpots[-1]:.3f} s "
          f"(the fake worker: {FIRST_TOKEN_S} s, {TOKEN_GAP_S} s)")

    figures = client_figures(outcomes, time_scale=2.0, class_names=["chat"])  # model time = 2 × wall
    assert figures["sent"] == 8 and figures["completed"] == 6
    assert figures["refused"] == 1 and figures["errors"] == 0 and figures["timed_out"] == 1
    # Nearest rank over all eight, the two misses at +∞ last: the 4th TTFT; TPOT over the six that streamed.
    assert figures["ttft_p50_s"] == pytest.approx(2 * ttfts[3]) and figures["ttft_p50_s"] >= 2 * FIRST_TOKEN_S
    assert math.isinf(figures["ttft_p99_s"])  # the refused and the hung request are misses at +∞
    assert figures["tpot_p50_s"] == pytest.approx(2 * tpots[2]) and figures["tpot_p50_s"] >= 2 * TOKEN_GAP_S * 0.9
    assert all(2 * t <= SLO_S for t in ttfts), "a loaded host delayed a first token past the SLO's room"
    assert figures["goodput_ratio"] == pytest.approx(6 / 8)  # every streamed request is inside the SLO
    assert figures["goodput_by_class"] == {"chat": pytest.approx(6 / 8)}
    assert len(figures["ttft_samples_s"]) == 6 and figures["output_tokens"] == 6 * TOKENS
    slowest = figures["slowest"]  # the tail's requests, slowest first: the two misses, then the longest TTFT
    assert [s["ttft_s"] for s in slowest[:2]] == ["inf", "inf"] and {s["status"] for s in slowest[:2]} >= {429}
    assert slowest[2]["ttft_s"] == pytest.approx(2 * ttfts[-1], abs=1e-3) and len(slowest) == 8
    assert all(s["sent_s"] >= 0 and s["workload"] == "chat" for s in slowest)
    assert counters.sent == 8 and counters.first_tokens == 6

    slow = SLO_S / FIRST_TOKEN_S * 1.01  # every TTFT of at least the fake's delay is past the SLO in model time
    tight = client_figures(outcomes, time_scale=slow, class_names=["chat"])
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
