"""The chaos soak's measuring code, driven by fakes of known timing and content."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence

import aiohttp
import pytest

from bench.chaos import XDS_CLUSTER, _add_xds_endpoint, chaos_config
from bench.soak_measure import (
    COMPLETED,
    CUT,
    ERROR_EVENT,
    HUNG,
    NON_STREAMING,
    STREAMING,
    MemorySample,
    QuotaLedger,
    Sent,
    class_rows,
    memory_rows,
    per_minute,
    read_stream,
)
from controller.xds.bootstrap import render_bootstrap
from poolgate.kernel.config import parse_config

TEXT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}\n\n'
ERROR = b'data: {"error":{"message":"worker went away","type":"server_error"}}\n\n'
DONE = b"data: [DONE]\n\n"


async def timed(chunks: Sequence[tuple[float, bytes]], then_wait_s: float = 0.0,
                fail: Exception | None = None) -> AsyncIterator[bytes]:
    """Yield each chunk after its delay; then stay silent ``then_wait_s`` (a hang) or raise ``fail``."""
    for delay, chunk in chunks:
        await asyncio.sleep(delay)
        yield chunk
    if fail is not None:
        raise fail
    await asyncio.sleep(then_wait_s)


async def trickle(gap_s: float) -> AsyncIterator[bytes]:
    """A stream that sends a text event every ``gap_s`` and never ends."""
    while True:
        await asyncio.sleep(gap_s)
        yield TEXT


def test_a_finished_stream_completes_with_its_first_token_time_and_usage() -> None:
    end = asyncio.run(read_stream(timed([(0.0, b": keep-alive\n\n"), (0.05, TEXT), (0.0, USAGE), (0.0, DONE)]),
                                  idle_s=5, total_s=10))
    assert (end.end, end.usage_tokens) == (COMPLETED, 10)
    assert end.ttft_s is not None and end.ttft_s >= 0.05


def test_a_silent_stream_is_hung_after_the_idle_bound_not_when_the_server_gives_up() -> None:
    end = asyncio.run(read_stream(timed([(0.0, TEXT)], then_wait_s=30.0), idle_s=0.2, total_s=60))
    assert end.end == HUNG
    assert 0.2 <= end.elapsed_s < 30.0
    print(f"hang noticed after {end.elapsed_s:.2f} s")


def test_a_stream_that_trickles_forever_is_hung_at_the_total_bound() -> None:
    end = asyncio.run(read_stream(trickle(0.02), idle_s=5, total_s=0.3))
    assert end.end == HUNG and end.elapsed_s >= 0.3 and end.ttft_s is not None


@pytest.mark.parametrize(("chunks", "fail", "expected"), [
    ([(0.0, TEXT), (0.0, ERROR), (0.0, DONE)], None, ERROR_EVENT),
    ([(0.0, TEXT)], None, CUT),
    ([(0.0, TEXT)], aiohttp.ClientPayloadError("connection reset"), CUT),
])
def test_a_stream_ends_with_an_error_event_or_is_cut(chunks: list[tuple[float, bytes]], fail: Exception | None,
                                                     expected: str) -> None:
    assert asyncio.run(read_stream(timed(chunks, fail=fail), idle_s=5, total_s=10)).end == expected


def test_an_event_split_across_chunks_is_read_whole() -> None:
    body = TEXT + USAGE + DONE
    chunks = [(0.0, body[i:i + 7]) for i in range(0, len(body), 7)]
    end = asyncio.run(read_stream(timed(chunks), idle_s=5, total_s=10))
    assert end.end == COMPLETED and end.ttft_s is not None


def test_per_minute_p99_is_the_nearest_rank_of_each_minutes_first_tokens() -> None:
    sent = [Sent(STREAMING, "chat", sent_s=i * 0.5, ok=True, ttft_s=(i + 1) / 100) for i in range(100)]
    sent += [Sent(NON_STREAMING, "code", sent_s=70.0 + i, ok=True, ttft_s=2.0 + i) for i in range(3)]
    sent += [Sent(NON_STREAMING, "code", sent_s=75.0, ok=False, error="HTTP 503")]
    rows = per_minute(sent)
    assert [r["minute"] for r in rows] == [1, 2]
    assert rows[0]["requests"] == 100 and rows[0]["failed"] == 0
    assert rows[0]["stream_p99_ttft_ms"] == pytest.approx(990.0)
    assert math.isnan(rows[0]["non_stream_p99_ttft_ms"])
    assert rows[1]["requests"] == 4 and rows[1]["failed"] == 1
    assert rows[1]["non_stream_p99_ttft_ms"] == pytest.approx(4000.0)


def test_class_rows_count_how_streams_ended() -> None:
    sent = [Sent(STREAMING, "chat", 0, ok=True, end=COMPLETED), Sent(STREAMING, "chat", 0, end=HUNG,
                                                                     error="stream hung"),
            Sent(STREAMING, "chat", 0, end=CUT, error="stream cut"), Sent(NON_STREAMING, "code", 0, ok=True)]
    non_streaming, streaming = class_rows(sent)
    assert (non_streaming["sent"], non_streaming["success_pct"]) == (1, 100.0)
    assert (streaming[COMPLETED], streaming[HUNG], streaming[CUT], streaming[ERROR_EVENT]) == (1, 1, 1, 0)
    assert streaming["failed"] == 2 and "stream hung ×1" in streaming["errors"]


def _quota_sent(reported: Sequence[int], cut: int = 0, refused: int = 0) -> list[Sent]:
    sent = [Sent(NON_STREAMING, "chat", 0, ok=True, tenant="t", usage_tokens=n) for n in reported]
    sent += [Sent(STREAMING, "chat", 0, tenant="t", error="stream cut", status=200) for _ in range(cut)]
    sent += [Sent(NON_STREAMING, "chat", 0, tenant="t", status=429, error="HTTP 429") for _ in range(refused)]
    sent += [Sent(NON_STREAMING, "chat", 0, ok=True, tenant="", usage_tokens=999)]  # another tenant
    return sent


def test_quota_counters_that_match_the_reported_usage_show_no_drift() -> None:
    ledger = QuotaLedger("t", reservation_bound=1000)
    for minute, value in ((10, 100), (10, 250), (11, 50), (11, None)):  # a later reading wins; expiry keeps it
        ledger.observe(minute, value)
    verdict = ledger.verdict(_quota_sent([200, 60, 40], refused=2))
    assert (verdict["counted_tokens"], verdict["usage_reported_tokens"], verdict["drift_tokens"]) == (300, 300, 0)
    assert verdict["at_risk_requests"] == 0 and verdict["no_drift"] is True


def test_quota_drift_is_bounded_by_the_requests_cut_after_admission() -> None:
    ledger = QuotaLedger("t", reservation_bound=1000)
    ledger.observe(10, 300 + 700)
    explained = ledger.verdict(_quota_sent([300], cut=1))
    assert (explained["drift_tokens"], explained["drift_bound_tokens"], explained["no_drift"]) == (700, 1000, True)
    ledger.observe(10, 300 + 2500)
    unexplained = ledger.verdict(_quota_sent([300], cut=1))
    assert unexplained["no_drift"] is False and unexplained["unexplained_drift_tokens"] == 1500
    at_risk = [Sent(NON_STREAMING, "chat", 10.0, ok=True, tenant="t", usage_tokens=300, elapsed_s=5.0),
               Sent(NON_STREAMING, "chat", 20.0, ok=True, tenant="t", usage_tokens=0, elapsed_s=1.0)]
    ledger.observe(10, 300 + 900)  # the first was in flight when its extproc died: its correction was lost
    assert ledger.verdict(at_risk)["no_drift"] is False
    in_flight = ledger.verdict(at_risk, outages=[(12.0, 12.0)])
    assert (in_flight["at_risk_requests"], in_flight["no_drift"]) == (1, True)
    lost = QuotaLedger("t", reservation_bound=1000)
    lost.observe(10, 100)  # fewer tokens counted than were used: charges lost
    assert lost.verdict(_quota_sent([300]))["no_drift"] is False


def test_charges_lost_while_redis_was_away_are_put_in_their_minute_and_bounded_by_their_usage() -> None:
    ledger = QuotaLedger("t", reservation_bound=1000, epoch_s=600.0)  # sent_s 0 is the start of minute 10
    sent = [Sent(NON_STREAMING, "chat", 5.0, ok=True, tenant="t", usage_tokens=100, elapsed_s=2.0),
            Sent(NON_STREAMING, "chat", 30.0, ok=True, tenant="t", usage_tokens=200, elapsed_s=2.0),  # fail-open
            Sent(NON_STREAMING, "chat", 70.0, ok=True, tenant="t", usage_tokens=50, elapsed_s=2.0)]
    ledger.observe(10, 100)
    ledger.observe(11, 50)
    assert ledger.verdict(sent)["no_drift"] is False
    verdict = ledger.verdict(sent, outages=[(25.0, 35.0)])
    assert (verdict["drift_tokens"], verdict["drift_bound_tokens"], verdict["no_drift"]) == (-200, 200, True)
    rows = ledger.minutes(sent, outages=[(25.0, 35.0)])
    assert [(r["minute"], r["counted"], r["reported"], r["drift"], r["at_risk"]) for r in rows] == [
        (10, 100, 300, -200, 1), (11, 50, 50, 0, 0)]


def test_memory_trend_runs_over_the_window_and_across_restarts_once_warm() -> None:
    samples = [MemorySample(t, "envoy", 1, 100.0 + t / 60) for t in range(0, 1801, 60)]  # +30 % in 30 min
    samples += [MemorySample(t, "redis", 2, 10.0) for t in range(0, 901, 60)]
    samples += [MemorySample(900 + 20, "redis", 3, 5.0)]  # restarted: the first minute does not count
    samples += [MemorySample(t, "redis", 3, 10.4) for t in range(1000, 1801, 60)]
    samples += [MemorySample(0, "worker", 4, 50.0), MemorySample(60, "worker", 4, 51.0)]  # none in the window
    rows = {r["process"]: r for r in memory_rows(samples, window_from_s=600, tolerance=0.10)}
    assert rows["envoy"]["within"] is False and rows["envoy"]["window_change_pct"] == pytest.approx(
        (130 - 110) / 110 * 100)
    assert rows["redis"]["within"] is True and rows["redis"]["incarnations"] == 2
    assert rows["redis"]["window_change_pct"] == pytest.approx(4.0)
    assert rows["worker"]["within"] is None


def test_envoy_of_the_chaos_stack_reaches_both_controllers_for_xds() -> None:
    config = parse_config(chaos_config("token", "sk-key"))
    bootstrap = render_bootstrap(config, node_id="n", listen_port=1, admin_port=2, extproc_port=(3, 4), xds_port=5)
    _add_xds_endpoint(bootstrap, 6)
    cluster = next(c for c in bootstrap["static_resources"]["clusters"] if c["name"] == XDS_CLUSTER)
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"]
             for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert ports == [5, 6]
