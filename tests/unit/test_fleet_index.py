"""The fleet index: each snapshot it builds from changes equals a full build of the same records, shares
every served name and ``by_id`` shard the changes did not touch, and is the very same object when nothing
changed; time passing turns workers stale (or their agent facts unknown) without a change."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from extproc.snapshot import BY_ID_SHARDS, FleetIndex, FleetSnapshot, build_snapshot
from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import WorkerRecord, WorkerState

NOW = 1_000.0
STALE_S = 3.0
POOLS = (PoolSpec(name="chat", model="llama"), PoolSpec(name="chat-2", model="llama", task_classes=("streaming",)),
         PoolSpec(name="code", model="coder"), PoolSpec(name="tiny", model="phi"))
MODEL_OF = {pool.name: pool.model for pool in POOLS}


def worker(worker_id: str, pool: str = "chat", **fields: object) -> WorkerRecord:
    values: dict[str, object] = {"updated_at": NOW, "port": 8000, **fields}
    return WorkerRecord(id=worker_id, pool=pool, model=MODEL_OF.get(pool, "other"), host="10.0.0.1",
                        **values)  # type: ignore[arg-type]


def fleet() -> dict[str, WorkerRecord]:
    pools = ("chat", "chat-2", "code", "tiny")
    return {f"w{i:02d}": worker(f"w{i:02d}", pools[i % 4], max_model_len=4096 * (1 + i % 3),
                                gpu_memory_free_mib=float(100 * i)) for i in range(20)}


def same_as_full_build(snapshot: FleetSnapshot, records: dict[str, WorkerRecord], taken_at: float,
                       vouched: bool = False) -> None:
    full = build_snapshot(records.values(), POOLS, taken_at, STALE_S, vouched=vouched)
    assert snapshot == full  # every field: indexes, ids, models, freshness, counts
    assert sorted(w.id for w in snapshot.workers) == sorted(w.id for w in full.workers)


def shared_shards(a: FleetSnapshot, b: FleetSnapshot) -> int:
    return sum(x is y for x, y in zip(a.by_id._shards, b.by_id._shards, strict=True))


def test_one_changed_worker_rebuilds_only_its_model_and_equals_a_full_build() -> None:
    records = fleet()
    index = FleetIndex(POOLS, STALE_S)
    before = index.replace(records.values(), NOW)
    records["w02"] = replace(records["w02"], kv_usage=0.7, updated_at=NOW + 1)  # a "code" worker
    after = index.update({"w02": records["w02"]}, NOW + 1)
    assert after is not before and after.by_id["w02"].kv_usage == 0.7
    same_as_full_build(after, records, NOW + 1)
    for model in ("llama", "phi"):  # untouched: the previous snapshot's own tuples
        assert after.by_model[model] is before.by_model[model]
        assert after.ready_by_model[model] is before.ready_by_model[model]
    assert after.by_model["coder"] is not before.by_model["coder"]
    assert shared_shards(before, after) == BY_ID_SHARDS - 1


def test_an_update_that_changes_nothing_keeps_the_snapshot() -> None:
    records = fleet()
    index = FleetIndex(POOLS, STALE_S)
    snapshot = index.replace(records.values(), NOW)
    assert index.update({}, NOW + 1) is snapshot
    assert index.update({"w03": replace(records["w03"])}, NOW + 1) is snapshot  # re-read, same facts
    assert index.update({"w99": None}, NOW + 1) is snapshot  # unknown and gone
    renewed = index.update({}, NOW + 1.5, renew=True)
    assert renewed is not snapshot and renewed.taken_at == NOW + 1.5 and renewed.by_model is snapshot.by_model


def test_a_removed_worker_leaves_every_index_and_its_last_served_name_leaves_the_models() -> None:
    records = fleet()
    records["w50"] = worker("w50", "tiny", served_names=("phi-lora",))
    index = FleetIndex(POOLS, STALE_S)
    before = index.replace(records.values(), NOW)
    assert "phi-lora" in before.models and before.by_model["phi-lora"] == (records["w50"],)
    del records["w50"], records["w01"]
    after = index.update({"w50": None, "w01": None}, NOW + 1)
    assert "w50" not in after.by_id and "phi-lora" not in after.models and "phi-lora" not in after.by_model
    assert all(w.id != "w01" for w in after.workers_for("llama") + after.ready_workers_for("llama"))
    same_as_full_build(after, records, NOW + 1)


def test_a_worker_that_moves_pool_or_model_is_indexed_under_the_new_one_only() -> None:
    records = fleet()
    index = FleetIndex(POOLS, STALE_S)
    index.replace(records.values(), NOW)
    records["w00"] = worker("w00", "code")  # chat (llama) → code (coder)
    records["w04"] = replace(records["w04"], served_names=("llama-fast",))  # a new served name
    records["w08"] = worker("w08", "gone")  # a pool the config does not have: out of the snapshot
    moved = index.update({worker_id: records[worker_id] for worker_id in ("w00", "w04", "w08")}, NOW + 1)
    assert "w00" in {w.id for w in moved.workers_for("coder")}
    assert "w00" not in {w.id for w in moved.workers_for("llama")}
    assert [w.id for w in moved.workers_for("llama-fast")] == ["w04"] and "llama-fast" in moved.models
    assert "w08" not in moved.by_id
    del records["w08"]
    same_as_full_build(moved, records, NOW + 1)
    assert "llama" in moved.class_restricted_models and "coder" not in moved.class_restricted_models


def test_a_new_worker_below_the_last_id_keeps_the_id_order() -> None:
    records = fleet()
    index = FleetIndex(POOLS, STALE_S)
    index.replace(records.values(), NOW)
    records["w00a"] = worker("w00a", "chat")
    snapshot = index.update({"w00a": records["w00a"]}, NOW + 1)
    ids = [w.id for w in snapshot.workers_for("llama")]
    assert ids == sorted(ids) and "w00a" in ids
    same_as_full_build(snapshot, records, NOW + 1)


def test_a_worker_whose_heartbeats_stop_turns_stale_when_its_age_passes_the_bound() -> None:
    records = {"w01": worker("w01", updated_at=NOW), "w02": worker("w02", updated_at=NOW + 2)}
    index = FleetIndex(POOLS, STALE_S)
    fresh = index.replace(records.values(), NOW + 2)
    assert index.update({}, NOW + STALE_S) is fresh  # w01 is exactly at the bound: still fresh
    stale = index.update({}, NOW + STALE_S + 0.1)
    assert [w.id for w in stale.ready_workers_for("llama")] == ["w02"] and stale.stale_workers == 1
    assert not stale.is_fresh(stale.by_id["w01"])
    same_as_full_build(stale, records, NOW + STALE_S + 0.1)
    records["w01"] = replace(records["w01"], updated_at=NOW + 4)  # it heartbeats again
    back = index.update({"w01": records["w01"]}, NOW + 4)
    assert [w.id for w in back.ready_workers_for("llama")] == ["w01", "w02"] and back.stale_workers == 0


def test_agent_facts_become_unknown_once_the_agent_stops_reading_them() -> None:
    records = {"w01": worker("w01", kv_usage=0.5, kv_capacity_tokens=1000, metrics_at=NOW, updated_at=NOW + 10)}
    index = FleetIndex(POOLS, STALE_S)
    known = index.replace(records.values(), NOW + 1)
    assert known.by_id["w01"].kv_usage == 0.5
    unknown = index.update({}, NOW + STALE_S + 0.1)
    assert unknown.by_id["w01"].kv_capacity_tokens == 0 and unknown.by_id["w01"].kv_usage == 0.0
    same_as_full_build(unknown, records, NOW + STALE_S + 0.1)


def test_a_replaced_record_does_not_turn_stale_on_the_old_records_time() -> None:
    index = FleetIndex(POOLS, STALE_S)
    index.replace([worker("w01", updated_at=NOW)], NOW)
    renewed = worker("w01", updated_at=NOW + 2)
    snapshot = index.update({"w01": renewed}, NOW + 2)
    assert index.update({}, NOW + STALE_S + 0.5) is snapshot  # the first record's moment has passed
    assert snapshot.ready_workers_for("llama") == (renewed,)


def test_a_vouched_fleet_never_turns_stale_by_updated_at() -> None:
    records = {"w01": worker("w01", updated_at=NOW - 100)}
    index = FleetIndex(POOLS, STALE_S, vouched=True)
    snapshot = index.replace(records.values(), NOW)
    assert snapshot.ready_workers_for("llama") == (records["w01"],) and snapshot.stale_workers == 0
    assert index.update({}, NOW + 10 * STALE_S) is snapshot
    assert snapshot.is_fresh(records["w01"]) and snapshot.seen_at(records["w01"]) == NOW


@pytest.mark.parametrize("seed", range(5))
def test_any_run_of_changes_and_time_gives_what_a_full_build_gives(seed: int) -> None:
    rng = random.Random(seed)
    records = fleet()
    index = FleetIndex(POOLS, STALE_S)
    now = NOW
    index.replace(records.values(), now)
    for _ in range(200):
        now += rng.choice((0.0, 0.1, 0.5, 2.0))
        changes: dict[str, WorkerRecord | None] = {}
        for _ in range(rng.randrange(0, 4)):
            worker_id = f"w{rng.randrange(30):02d}"
            roll = rng.random()
            if roll < 0.2:
                records.pop(worker_id, None)
                changes[worker_id] = None
            else:
                pool = rng.choice(("chat", "chat-2", "code", "tiny", "gone")) if roll < 0.4 else \
                    records.get(worker_id, worker(worker_id)).pool
                records[worker_id] = worker(
                    worker_id, pool, updated_at=now - rng.choice((0.0, 1.0, 4.0)),
                    metrics_at=rng.choice((0.0, now, now - 2.5)), kv_usage=rng.random(),
                    state=rng.choice((WorkerState.READY, WorkerState.READY, WorkerState.DRAINING)),
                    max_model_len=rng.choice((4096, 8192)), gpu_memory_free_mib=rng.choice((-1.0, 10.0, 500.0)),
                    served_names=rng.choice(((), (), ("llama-fast",))))
                changes[worker_id] = records[worker_id]
        snapshot = index.update(changes, now)
        # a snapshot kept because nothing changed still judges every worker as a build at ``now`` would
        same_as_full_build(replace(snapshot, taken_at=now), {i: r for i, r in records.items() if r.pool in MODEL_OF},
                           now)
