"""Autoscaling end to end on simulated workers: a 3× load step scales the pool up and time to first token
recovers; when the load drops the pool scales down through drains with no failed request."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from poolgate.kernel.keys import RedisKeys
from tests.e2e.conftest import RunningStack, poolgate_up
from tests.e2e.test_lifecycle_fleet import BackgroundLoad, Outcome, wait_for

pytestmark = pytest.mark.e2e

SEQS = ["--max-num-seqs", "4"]
"""A small engine (4 sequences at once) so a few concurrent clients saturate it."""
CONFIG = {
    "key_prefix": "lca",
    "controller": {"token": "lca-token", "heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 1.0},
    "health": {"probe_interval_s": 0.25, "probe_timeout_s": 0.5},
    "drain": {"grace_s": 20, "settle_s": 0.5, "poll_s": 0.1},
    "autoscale": {"enabled": True, "interval_s": 0.5, "up_waiting_per_worker": 1.0, "up_sustain_s": 2.0,
                  "down_running_per_worker": 3.0, "down_cooldown_s": 5.0,
                  "pools": {"burst": {"min_workers": 1, "max_workers": 3, "template": {"extra_args": SEQS}}}},
    "pools": [{"name": "burst", "model": "burst-model", "max_model_len": 4096}],
    "workers": [{"id": "burst-1", "pool": "burst", "extra_args": SEQS}],
}
BODY = {"model": "burst-model", "messages": [{"role": "user", "content": "hello " * 20}], "max_tokens": 48,
        "stream": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(redis_server: object) -> Iterator[RunningStack]:
    with poolgate_up(CONFIG, redis_server.url) as running:  # type: ignore[attr-defined]
        yield running


def ready_workers(stack: RunningStack) -> int:
    return sum(stack.state(w) == "Ready" for w in stack.pool_ids("burst"))


def median_latency(outcomes: list[Outcome], since: float, until: float, finished: dict[int, float]) -> float:
    values = [finished[id(o)] for o in outcomes if since <= o.started_at < until and id(o) in finished]
    return statistics.median(values) if values else float("nan")


def pool_facts(stack: RunningStack) -> str:
    """What the autoscaler last said of the pool and what it reads: the workers' engine facts, extproc's
    in-flight counts and queue."""
    holds = [line for line in (stack.run_dir / "controller.log").read_text().splitlines() if "hold at" in line]
    records = {w: {k: v for k, v in stack.record(w).items() if k in ("state", "running", "waiting", "metrics_at")}
               for w in stack.pool_ids("burst")}
    client = redis.Redis.from_url(stack.redis_url)
    try:
        keys = RedisKeys(stack.prefix)
        counts = {"inflight": client.hgetall(keys.inflight), "queued": client.hgetall(keys.queued("burst"))}
    finally:
        client.close()
    return f"{holds[-3:]}; records {records}; {counts}"


def test_load_step_scales_up_and_load_drop_scales_down(stack: RunningStack) -> None:
    base = BackgroundLoad(stack.base_url, 4, BODY)
    time.sleep(4.0)
    step_at = time.monotonic()
    extra = BackgroundLoad(stack.base_url, 8, BODY)  # 3× the clients
    scaled = wait_for(lambda: ready_workers(stack) >= 2, 30, 0.1)
    full = wait_for(lambda: ready_workers(stack) >= 3, 30, 0.1) + scaled
    time.sleep(4.0)
    recovered_from = time.monotonic() - 3.0
    drop_at = time.monotonic()
    stepped = extra.stop()
    try:
        shrunk = wait_for(lambda: len(stack.pool_ids("burst")) <= 2, 40, 0.1)
    except AssertionError as exc:
        raise AssertionError(f"no scale-down: {pool_facts(stack)}") from exc
    baseline = base.stop()
    outcomes = baseline + stepped
    failed = [o for o in outcomes if not o.done]

    def latency(since: float, until: float) -> float:
        values = [o.latency_s for o in outcomes if since <= o.started_at < until and o.done]
        return statistics.median(values) if values else float("nan")

    before = latency(step_at - 3.0, step_at)
    pressure = latency(step_at, step_at + scaled)
    after = latency(recovered_from, drop_at)
    metrics = httpx.get(f"{stack.controller_url()}/metrics", timeout=5).text
    ups = [line for line in metrics.splitlines() if line.startswith("poolgate_autoscale_decisions_total")
           and 'action="up"' in line]
    print(f"\nmeasured: 3× load step → 2 workers after {scaled:.1f} s, 3 after {full:.1f} s; median request "
          f"time {before * 1000:.0f} ms before, {pressure * 1000:.0f} ms under pressure, {after * 1000:.0f} ms "
          f"after scaling; load drop → scaled down after {shrunk:.1f} s; {len(outcomes)} requests, "
          f"{len(failed)} failed; decisions: {ups}")
    assert scaled < 10.0 + 2.0, "scale-up within 10 s of sustained pressure (+ the sustain window)"
    assert after < pressure
    assert not failed, [o.error for o in failed][:3]
    assert ups and float(ups[0].split()[-1]) >= 1
