"""The lab's lower bound on a request's time to first token: what an idle engine of the fleet takes for it
with every block an earlier request sent cached, held to the simulated engine itself."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench import lab
from bench.lab_bound import bounds
from bench.lab_fleet import LabWorker, WorkerPlan
from bench.lab_routers import LabRequest
from simworker.engine import Engine
from tests.unit.test_lab import request

H100 = {"llama": ["h100-80gb"]}


def engine_ttft(requests: list[LabRequest], preset: str = "h100-80gb") -> list[float]:
    """Each request's time to first token on one idle engine of ``preset`` without jitter, sent one after the
    other once the one before has finished (the cache keeps what they computed)."""
    worker = LabWorker(WorkerPlan("w-0", "chat", "llama", preset, 32_768), seed=1)
    engine = Engine(replace(worker.config, step_jitter=0.0), worker.recorder)
    now, out = 0.0, []
    for made in requests:
        engine.add_request(made.engine, now)
        while engine.has_work:
            outcome = engine.step(now)
            now = outcome.start + outcome.duration_s
            out.extend(t for request_id, t in outcome.first_token_times if request_id == made.engine.request_id)
    return out


@pytest.mark.parametrize("tokens", [40, 3_000, 20_000])
def test_a_new_prompt_is_bounded_by_its_prefill_on_an_idle_engine(tokens: int) -> None:
    """One chunk, or several of the batched-token budget (8,192 on an H100): the bound is the engine's own time."""
    made = request(0, list(range(1, tokens + 1)))
    (seconds, cached), = bounds([made], H100)
    assert cached == 0
    assert seconds == pytest.approx(engine_ttft([made])[0], rel=1e-9)


def test_a_prompt_an_earlier_one_sent_computes_only_what_is_new_and_its_last_token() -> None:
    document = list(range(1, 4_001))  # 250 blocks
    first, again, longer = request(0, document), request(1, document), request(2, [*document, *range(9, 109)])
    (_, none), (repeat_s, repeat_cached), (longer_s, longer_cached) = bounds([first, again, longer], H100)
    assert none == 0
    assert repeat_cached == 3_984  # all but the block holding the last token, which the engine computes again
    assert longer_cached == 4_000
    measured = engine_ttft([first, again, longer])
    assert repeat_s == pytest.approx(measured[1], rel=1e-9)
    assert longer_s == pytest.approx(measured[2], rel=1e-9)


def test_another_models_prompt_shares_nothing_and_the_faster_kind_sets_the_bound() -> None:
    made = request(0, list(range(1, 2_001)))
    other = replace(request(1, list(range(1, 2_001))), model="coder")
    both = {"llama": ["l4-24gb", "h100-80gb"], "coder": ["l4-24gb"]}
    (h100_s, _), (l4_s, other_cached) = bounds([made, other], both)
    assert other_cached == 0
    assert h100_s == pytest.approx(engine_ttft([made], "h100-80gb")[0], rel=1e-9)
    assert l4_s == pytest.approx(engine_ttft([made], "l4-24gb")[0], rel=1e-9) and l4_s > 5 * h100_s


def test_the_bound_is_no_peer_and_is_read_against_the_best_peer() -> None:
    rows = [{"cell": "c", "seed": 7, "router": name, "ttft_p99_s": p99, "goodput": 1.0}
            for name, p99 in (("poolgate", 1.0), ("cache_aware", 2.0), (lab.BOUND, 0.5))]
    summary = {row["router"]: row for row in lab.over_seeds(rows)}
    assert summary["poolgate"]["p99_over_best_peer_median"] == pytest.approx(0.5)
    assert summary[lab.BOUND]["p99_over_best_peer_median"] == pytest.approx(0.25)


def test_every_router_of_a_cell_is_at_or_above_the_bound() -> None:
    from extproc.scheduling import RequestProfiler
    from poolgate.kernel.config import SchedulingSettings

    settings = SchedulingSettings()
    cell = lab.CellSpec("h100", "shared-docs", bursty=False, level=1.0, requests=160, seed=3)
    routers = [(name, lab.router_factory(name, 3, settings)) for name in ("poolgate", "least_request")]
    rows = {row["router"]: row for row in lab.run_cell(cell, routers, rate=4.0, profiler=RequestProfiler(settings))}
    bound = rows[lab.BOUND]
    assert 0 < bound["ttft_p50_s"] <= bound["ttft_p99_s"]
    for name in ("poolgate", "least_request"):
        assert rows[name]["ttft_p99_s"] >= bound["ttft_p99_s"] and rows[name]["ttft_p50_s"] >= bound["ttft_p50_s"]
        assert rows[name]["prefix_hit"] <= bound["prefix_hit"]
