"""The simulated worker's adapter table: slots, errors and the vLLM-shaped metric the agent parses."""

from __future__ import annotations

import itertools

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from agent.vllm_metrics import parse_engine_metrics
from simworker.lora import AdapterTable
from simworker.protocol import WorkerApiError


def table(max_loras: int = 2) -> AdapterTable:
    ticks = itertools.count(1000.0)
    return AdapterTable(max_loras, CollectorRegistry(), clock=lambda: next(ticks))


def parsed(adapters: AdapterTable) -> tuple[tuple[str, ...] | None, int | None]:
    metrics = parse_engine_metrics(generate_latest(adapters.registry).decode())
    return metrics.lora_adapters, metrics.max_loras


def test_slots_and_errors() -> None:
    adapters = table(max_loras=1)
    adapters.reserve("sql", "/adapters/sql")
    with pytest.raises(WorkerApiError) as twice:
        adapters.reserve("sql", "/adapters/sql")
    assert twice.value.status == 400 and "already been loaded" in twice.value.message
    with pytest.raises(WorkerApiError) as full:
        adapters.reserve("chat", "/adapters/chat")
    assert full.value.status == 400 and "slots" in full.value.message
    with pytest.raises(WorkerApiError) as unknown:
        adapters.release("chat")
    assert unknown.value.status == 404
    adapters.release("sql")
    adapters.reserve("chat", "/adapters/chat")
    assert adapters.loaded == {"chat": "/adapters/chat"}


def test_metric_follows_requests_and_latest_series_wins() -> None:
    adapters = table(max_loras=3)
    assert parsed(adapters) == ((), 3)
    adapters.begin("r1", "sql")
    adapters.begin("r2", "chat")
    assert parsed(adapters) == (("chat", "sql"), 3)
    adapters.started("r1")
    text = generate_latest(adapters.registry).decode()
    assert 'running_lora_adapters="sql",waiting_lora_adapters="chat"' in text
    adapters.end("r1")
    adapters.end("r2")
    assert parsed(adapters) == ((), 3)  # the old label sets linger; the newest one is empty
