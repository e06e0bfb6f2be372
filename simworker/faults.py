"""Fault knobs of a simulated worker: what can go wrong, as plain settings.

=====================  =========================================================================
setting                effect
=====================  =========================================================================
error_rate             share of inference requests answered with a 500 OpenAI-style error
added_latency_s        extra delay before a request reaches the engine
hang                   every endpoint except ``/sim/faults`` accepts and never answers
crash_after_requests   the request after the N-th inference request kills the worker
crash_at_s             the worker dies this many seconds after start
kv_leak_blocks_per_s   KV blocks lost per second (capacity shrinks, usage rises)
slow_start_s           ``/health`` and inference answer 503 for this long after start
=====================  =========================================================================

A crash is per worker, as when a vLLM engine core dies: in-flight requests are cut, ``/health``
turns 503, inference answers 500, and a second later the worker's listener closes (connection
refused, like a dead process). When every worker of the process has crashed, the process exits
with status 1, so with one worker per process a crash is a process exit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class FaultSettings:
    error_rate: float = 0.0
    added_latency_s: float = 0.0
    hang: bool = False
    crash_after_requests: int | None = None
    crash_at_s: float | None = None
    kv_leak_blocks_per_s: float = 0.0
    slow_start_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError(f"error_rate must be within [0, 1], got {self.error_rate}")
        for name in ("added_latency_s", "kv_leak_blocks_per_s", "slow_start_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.crash_after_requests is not None and self.crash_after_requests < 0:
            raise ValueError(f"crash_after_requests must be >= 0 or null, got {self.crash_after_requests}")
        if self.crash_at_s is not None and self.crash_at_s < 0:
            raise ValueError(f"crash_at_s must be >= 0 or null, got {self.crash_at_s}")

    def updated(self, changes: Mapping[str, object]) -> FaultSettings:
        """New settings with ``changes`` applied; ValueError names the offending field."""
        fields = {field.name: field for field in dataclasses.fields(self)}
        values: dict[str, object] = {}
        for name, value in changes.items():
            if name not in fields:
                raise ValueError(f"unknown fault setting {name!r}; known: {', '.join(sorted(fields))}")
            values[name] = _checked(name, value)
        return dataclasses.replace(self, **values)  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _checked(name: str, value: object) -> object:
    default = getattr(FaultSettings(), name)
    if name == "hang":
        if not isinstance(value, bool):
            raise ValueError(f"hang must be true or false, got {value!r}")
        return value
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if name == "crash_after_requests":
        if not float(value).is_integer():
            raise ValueError(f"crash_after_requests must be an integer, got {value!r}")
        return int(value)
    return float(value)
