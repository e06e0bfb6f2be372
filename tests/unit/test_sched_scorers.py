"""Each scorer's formula on hand-built workers: scores in [0, 1], higher is better, in the candidates' order."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from extproc.request import RequestFacts
from extproc.scheduling import PLUGINS, PickContext, PickRequest
from extproc.scheduling.scorers.kv_headroom import KvHeadroom
from extproc.scheduling.scorers.least_inflight import LeastInflight
from extproc.scheduling.scorers.predicted_ttft import PredictedTtft
from extproc.scheduling.scorers.prefix_affinity import PrefixAffinity
from extproc.snapshot import build_snapshot
from poolgate.kernel.config import PoolSpec, SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord

NOW = 1_000.0
POOLS = (PoolSpec(name="chat", model="llama"),)


def worker(worker_id: str, **fields: object) -> WorkerRecord:
    return WorkerRecord(id=worker_id, pool="chat", model="llama", host="h", port=1, updated_at=NOW,
                        **fields)  # type: ignore[arg-type]


def request(prompt: int = 1000, output: int = 0, keys: tuple[Hashable, ...] = (), session: str = "") -> PickRequest:
    facts = RequestFacts("/v1/chat/completions", "POST", "llama", session_id=session)
    return PickRequest(facts, prompt, prompt, output, "short_chat", keys)


def context(workers: list[WorkerRecord], **accounting: object) -> PickContext:
    return PickContext(build_snapshot(workers, POOLS, NOW, 3.0), **accounting)  # type: ignore[arg-type]


def scores(scorer: object, req: PickRequest, workers: list[WorkerRecord], **accounting: object) -> list[float]:
    if "inflight" not in accounting:
        accounting["inflight"] = {}
    return list(scorer.score(req, workers, context(workers, **accounting)))  # type: ignore[attr-defined]


def test_every_configured_name_has_a_scorer_of_that_name() -> None:
    registry = PLUGINS.build_scorers(SchedulingSettings())
    assert set(registry) == set(PLUGINS.scorers) == set(PLUGINS.default_weights)
    assert all(scorer.name == name for name, scorer in registry.items())


@pytest.mark.parametrize(("waiting", "pending", "rate", "expected"), [
    (0, 0, 10_000.0, 0.5 / (0.5 + 0.1)),  # only its own prefill: 1000 tokens at 10k/s
    (4, 0, 10_000.0, 0.5 / (0.5 + 0.5)),  # four waiting of about the same size ahead
    (0, 4000, 10_000.0, 0.5 / (0.5 + 0.5)),  # placed here but not yet in the record
    (0, 0, 0.0, 0.5 / (0.5 + 0.125)),  # unknown rate: the default 8000/s
])
def test_predicted_ttft(waiting: int, pending: int, rate: float, expected: float) -> None:
    w = worker("w", waiting=waiting, prefill_tokens_per_s=rate)
    [score] = scores(PredictedTtft(8000.0, 0.5), request(1000), [w], pending_prefill_tokens={"w": pending})
    assert score == pytest.approx(expected)


def test_predicted_ttft_prefers_the_shorter_queue_and_the_faster_worker() -> None:
    workers = [worker("busy", waiting=3), worker("idle"), worker("fast", prefill_tokens_per_s=50_000.0)]
    busy, idle, fast = scores(PredictedTtft(8000.0, 0.5), request(2000), workers)
    assert 0 < busy < idle < fast <= 1


@pytest.mark.parametrize(("capacity", "usage", "reserved", "block", "expected"), [
    (10_000, 0.0, 0, 16, (10_000 * 0.98 - 1008) / 10_000),
    (10_000, 0.5, 0, 16, (10_000 * 0.48 - 1008) / 10_000),
    (10_000, 0.5, 2000, 16, (10_000 * 0.48 - 1008 - 2000) / 10_000),
    (10_000, 0.95, 0, 16, 0.0),  # would not fit: clamped
    (0, 0.0, 0, 16, 0.0),  # unknown capacity: low confidence
])
def test_kv_headroom(capacity: int, usage: float, reserved: int, block: int, expected: float) -> None:
    w = worker("w", kv_capacity_tokens=capacity, kv_usage=usage, kv_block_size=block)
    [score] = scores(KvHeadroom(0.02), request(1000), [w], reserved_kv_tokens={"w": reserved})
    assert score == pytest.approx(expected)


@pytest.mark.parametrize(("counts", "expected"), [
    ([0, 0, 0], [1.0, 1.0, 1.0]),
    ([0, 5, 10], [1.0, 0.5, 0.0]),
    ([3, 4], [1.0, 0.0]),
])
def test_least_inflight(counts: list[int], expected: list[float]) -> None:
    workers = [worker(str(i)) for i in range(len(counts))]
    assert scores(LeastInflight(), request(), workers, inflight={str(i): n for i, n in enumerate(counts)}) == expected


@pytest.mark.parametrize(("keys", "session", "affinity", "expected"), [
    ((), "", {}, [0.0, 0.0]),
    (("p4", "p3", "p2", "p1"), "", {}, [0.0, 0.0]),
    (("p4", "p3", "p2", "p1"), "", {"p4": "b"}, [0.0, 1.0]),  # whole hashed prefix seen on b
    (("p4", "p3", "p2", "p1"), "", {"p2": "a", "p1": "b"}, [0.5, 0.0]),  # longest match wins
    (("p4", "p3", "p2", "p1"), "", {"p3": "gone", "p1": "b"}, [0.0, 0.25]),  # a worker no longer a candidate
    ((("session", "s"), "p2", "p1"), "s", {("session", "s"): "a", "p2": "b"}, [1.0, 0.0]),  # session first
    ((("session", "s"), "p2", "p1"), "s", {"p1": "b"}, [0.0, 0.5]),
])
def test_prefix_affinity(keys: tuple[Hashable, ...], session: str, affinity: dict[Hashable, str],
                         expected: list[float]) -> None:
    workers = [worker("a"), worker("b")]
    assert scores(PrefixAffinity(), request(keys=keys, session=session), workers, affinity=affinity) == expected


@pytest.mark.parametrize("name", PLUGINS.scorers)
def test_scores_stay_in_the_unit_interval(name: str) -> None:
    scorer = PLUGINS.build_scorers(SchedulingSettings())[name]
    workers = [worker("a", kv_capacity_tokens=1000, kv_usage=1.0, waiting=100),
               worker("b", kv_capacity_tokens=10**6), worker("c")]
    values = scores(scorer, request(50_000, keys=("k",)), workers, inflight={"a": 9},
                    reserved_kv_tokens={"b": 10**7}, affinity={"k": "c"})
    assert all(0.0 <= v <= 1.0 for v in values)
