"""KV-cache arithmetic shared by the KV filter and the KV headroom scorer, so both judge room alike."""

from __future__ import annotations

from poolgate.kernel.fleet import WorkerRecord


def kv_footprint(tokens: int, block_size: int) -> int:
    """Tokens a request occupies in a paged cache: whole blocks, ceil(tokens / block) × block."""
    block = block_size or 1
    return (tokens + block - 1) // block * block


def kv_free_tokens(worker: WorkerRecord, reserve_fraction: float, reserved_tokens: float) -> float:
    """Free KV tokens the worker can promise now: capacity × (1 − reserve − usage) minus what extproc has
    already placed there since the agent's last reading."""
    return worker.kv_capacity_tokens * (1.0 - reserve_fraction - worker.kv_usage) - reserved_tokens
