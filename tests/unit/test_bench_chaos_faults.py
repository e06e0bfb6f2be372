"""The chaos soak's fault rotation over a stand-in stack: the kinds come in turn, each kind's targets rotate, and
the Redis fault is a master failover (the master killed through the Sentinel group, started again after),
never a plain kill of a process."""

from __future__ import annotations

from typing import Any, cast

import pytest

import bench.chaos as chaos
from bench.chaos import FAULTS, REDIS_FAULT, ChaosStack, FaultPlan, Worker


class StandInStack:
    """What ``FaultPlan`` asks of the stack, recorded."""

    def __init__(self) -> None:
        self.workers = [Worker("chat-1", "chat", 1), Worker("chat-2", "chat", 2), Worker("code-1", "code", 3)]
        self.killed: list[str] = []
        self.masters = [7001, 7002]
        self.restarted: list[int] = []
        self.delays: list[tuple[str, float]] = []

    async def leader(self) -> str | None:
        return "controller-b"

    def kill(self, name: str) -> bool:
        self.killed.append(name)
        return True

    async def fail_redis_master(self) -> int:
        return self.masters.pop(0)

    async def restart_redis_node(self, port: int) -> int | None:
        self.restarted.append(port)
        return port + 100

    async def back_after(self, name: str, since: float, timeout_s: float = 120.0) -> float | None:
        return 1.5

    async def set_delay(self, http: Any, worker: Worker, seconds: float) -> bool:
        self.delays.append((worker.id, seconds))
        return True


async def test_faults_come_in_turn_and_the_redis_fault_fails_the_master_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chaos, "DELAY_HOLD_S", 0.0)
    stack = StandInStack()
    plan = FaultPlan(cast(ChaosStack, stack), every_s=10.0, first_s=10.0)
    for second in range(5, 101, 5):
        await plan.tick(None, float(second))  # type: ignore[arg-type]
    await plan.settle()
    assert [e.fault for e in plan.events] == [*FAULTS, *FAULTS]
    assert [(e.fault, e.target) for e in plan.events if e.fault in ("worker", "extproc", REDIS_FAULT)] == [
        ("worker", "chat-1"), ("extproc", "extproc-0"), (REDIS_FAULT, "redis-7001"),
        ("worker", "chat-2"), ("extproc", "extproc-1"), (REDIS_FAULT, "redis-7002")]
    assert stack.killed == ["chat-1", "extproc-0", "controller-b", "chat-2", "extproc-1", "controller-b"]
    assert stack.restarted == [7001, 7002], "the killed masters were not started again"
    assert [e.note for e in plan.events if e.fault == REDIS_FAULT] == [
        "Sentinel failover to redis-7101", "Sentinel failover to redis-7102"]
    assert sorted(stack.delays) == [("chat-2", 0.0), ("chat-2", chaos.DELAY_S),
                                    ("code-1", 0.0), ("code-1", chaos.DELAY_S)], "delayed in turn, then undelayed"
    assert all(e.back_after_s == 1.5 for e in plan.events if e.fault != chaos.DELAY_FAULT)
