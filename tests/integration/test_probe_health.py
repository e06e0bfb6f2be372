"""The monitor's ``/health`` client against a real socket server: one kept-alive connection per worker, a
connection the worker closed is opened again, chunked and sized answers, and a refused connection, a 503 or no
answer in time is a failed probe with its reason; alike through ``probe`` and through ``ask`` (no coroutine)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from controller.health import ProbeResult
from controller.probe import HttpProber
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.net import free_port


class Worker:
    """Answers each ``GET /health`` with the next scripted answer (then 200), counting connections."""

    def __init__(self) -> None:
        self.connections = 0
        self.answers: list[bytes] = []
        self.close_after_answer = False
        self.server: asyncio.Server | None = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                answer = self.answers.pop(0) if self.answers else b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
                writer.write(answer)
                await writer.drain()
                if self.close_after_answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


@pytest.fixture()
async def worker() -> AsyncIterator[tuple[Worker, WorkerRecord]]:
    fake = Worker()
    fake.server = await asyncio.start_server(fake.serve, "127.0.0.1", 0)
    port = fake.server.sockets[0].getsockname()[1]
    yield fake, WorkerRecord(id="w1", pool="p", model="m", host="127.0.0.1", port=port)
    fake.server.close()
    await fake.server.wait_closed()


async def asked(prober: HttpProber, record: WorkerRecord) -> ProbeResult:
    """``prober.ask``'s result (the monitor's way: no coroutine where a connection is kept)."""
    result: asyncio.Future[ProbeResult | None] = asyncio.get_running_loop().create_future()
    prober.ask(record, result.set_result)
    answer = await result
    assert answer is not None
    return answer


@pytest.mark.parametrize("way", ["probe", "ask"])
async def test_probes_reuse_one_connection_and_reopen_one_the_worker_closed(
        worker: tuple[Worker, WorkerRecord], way: str) -> None:
    fake, record = worker
    prober = HttpProber(2.0, check_models=False)

    async def probe() -> ProbeResult:
        return await (prober.probe(record) if way == "probe" else asked(prober, record))

    for _ in range(5):
        assert (await probe()).ok
    assert fake.connections == 1
    fake.close_after_answer = True  # e.g. the worker's keep-alive timeout
    assert (await probe()).ok
    fake.close_after_answer = False
    assert (await probe()).ok  # the closed connection is noticed and a new one opened
    assert fake.connections == 2
    fake.answers = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\n\r\nbusy!"]
    assert (await probe()).ok
    result = await probe()
    assert not result.ok and result.reason == "/health answered 503"
    assert (await probe()).ok and fake.connections == 2  # answers read whole: still in step
    prober.close()


async def test_a_kept_connection_that_gets_no_answer_times_out_on_the_deadline(
        worker: tuple[Worker, WorkerRecord]) -> None:
    fake, record = worker
    prober = HttpProber(0.3, check_models=False)
    assert (await asked(prober, record)).ok
    fake.answers = [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf"]  # the rest never comes
    result = await asked(prober, record)
    assert not result.ok and result.reason == "no answer within 0.3 s" and 0.25 <= result.latency_s < 2.0
    assert (await asked(prober, record)).ok and fake.connections == 2  # the cut connection was not kept
    prober.close()


async def test_a_refused_connection_is_a_failed_probe() -> None:
    prober = HttpProber(2.0, check_models=False)
    result = await prober.probe(WorkerRecord(id="gone", pool="p", model="m", host="127.0.0.1", port=free_port()))
    assert not result.ok and result.reason == "connection refused"
