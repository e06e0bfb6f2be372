"""The scale benchmarks' fake workers: the controller's real prober finds them healthy and serving the bench
model, a completion sent in pieces gets one whole answer, and the sick ones fail completions only."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from bench.fake_workers import _FakeWorker, answers
from controller.probe import HttpProber
from poolgate.kernel.fleet import WorkerRecord


@pytest.fixture()
async def fake_port(request: pytest.FixtureRequest) -> AsyncIterator[int]:
    canned = answers(["bench-model"], fail_requests=getattr(request, "param", False))
    server = await asyncio.get_running_loop().create_server(lambda: _FakeWorker(canned), "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def test_the_controllers_prober_finds_a_fake_worker_healthy_and_serving(fake_port: int) -> None:
    prober = HttpProber(1.0, check_models=True)
    try:
        serving = WorkerRecord(id="w1", pool="p", model="bench-model", host="127.0.0.1", port=fake_port)
        other = WorkerRecord(id="w2", pool="p", model="other-model", host="127.0.0.1", port=fake_port)
        assert (await prober.probe(serving)).ok
        result = await prober.probe(other)
        assert not result.ok and "does not list" in result.reason
    finally:
        prober.close()


async def completion_in_pieces(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b'{"model": "bench-model", "prompt": "hi"}'
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body[:9]))
    await asyncio.sleep(0.05)
    assert not reader.at_eof()
    writer.write(body[9:] + b"GET /nowhere HTTP/1.1\r\nHost: w\r\n\r\n")
    async with asyncio.timeout(5):
        answer = await reader.readuntil(b"404 Not Found")
    writer.close()
    return answer


async def test_a_completion_sent_in_pieces_gets_one_answer_then_the_next_request_its_own(fake_port: int) -> None:
    answer = await completion_in_pieces(fake_port)
    assert answer.startswith(b"HTTP/1.1 200 OK") and answer.count(b"HTTP/1.1") == 2


@pytest.mark.parametrize("fake_port", [True], indirect=True)
async def test_a_sick_fake_worker_fails_completions_and_passes_probes(fake_port: int) -> None:
    answer = await completion_in_pieces(fake_port)
    assert answer.startswith(b"HTTP/1.1 500")
    prober = HttpProber(1.0, check_models=True)
    try:
        assert (await prober.probe(WorkerRecord(id="w1", pool="p", model="bench-model", host="127.0.0.1",
                                                port=fake_port))).ok
    finally:
        prober.close()
