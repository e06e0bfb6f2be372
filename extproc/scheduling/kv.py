"""KV-cache arithmetic shared by the KV filter and the KV headroom scorer, so both judge room alike."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from poolgate.kernel.fleet import WorkerRecord


def kv_footprint(tokens: int, block_size: int) -> int:
    """Tokens a request occupies in a paged cache: whole blocks, ceil(tokens / block) × block."""
    block = block_size or 1
    return (tokens + block - 1) // block * block


def kv_free_tokens(worker: WorkerRecord, reserve_fraction: float, reserved_tokens: float) -> float:
    """Free KV tokens the worker can promise now: capacity × (1 − reserve − usage) minus what extproc has
    already placed there since the agent's last reading."""
    return worker.kv_capacity_tokens * (1.0 - reserve_fraction - worker.kv_usage) - reserved_tokens


def kv_room_after(candidates: Sequence[WorkerRecord], tokens: int, reserve_fraction: float,
                  reserved: Mapping[str, int], cached: Mapping[str, int] | None = None) -> list[float]:
    """Each candidate's free KV tokens once a request of ``tokens`` is placed there (``kv_free_tokens`` less
    ``kv_footprint``), as a share of its capacity: negative where it does not fit, 0.0 where the capacity is
    unknown. The KV filter keeps the candidates where it is not negative, and the KV headroom scorer rates them
    by it: one loop for both, so they judge room alike.

    ``cached``: worker id → prompt tokens its cache already holds (the KV-event index). Those blocks are not
    allocated again: the request shares them, so only the rest of its footprint needs room. (A cached block
    nobody uses counts as free in the engine's usage and stops being free when the request takes it; the
    engine then waits for room a moment, it does not fail: a warm worker is never refused for the prompt it
    already holds.)"""
    usable = 1.0 - reserve_fraction
    held = reserved.get
    hit = (cached or {}).get
    room = []
    for w in candidates:
        capacity = w.kv_capacity_tokens
        if capacity <= 0:
            room.append(0.0)
            continue
        block = w.kv_block_size or 1
        needed = tokens - hit(w.id, 0)
        room.append((capacity * (usable - w.kv_usage) - held(w.id, 0) - (needed + block - 1) // block * block)
                    / capacity)
    return room
