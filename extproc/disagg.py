"""Prefill/decode disaggregation: which requests are split over two workers, and the pair they get.

For a model with ``role: prefill`` pools, a prompt of at least ``disaggregation.min_prompt_tokens`` gets two
picks by the same scheduler over the same snapshot: the decode worker among the model's other pools (the
whole request: its KV room for prompt and output, its decode load), then the prefill worker among the
prefill pools (prompt and one token: the predicted time to first token and the cached prefix decide). The
answer sends the request to the sidecar (``PD_SIDECAR_CLUSTER``) with both workers in headers; the sidecar
runs the two steps. A shorter prompt, or any prompt while no prefill worker is ready, is one ordinary pick
among the decode-capable pools; prefill pools never get a plain request. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from extproc.scheduling import Decision, NoCapacity, PickContext, PickRequest, Scheduler
from extproc.scheduling.plugins import Outcome
from poolgate.kernel.config import Config
from poolgate.kernel.routing import DECODE_HEADER, PD_SIDECAR_CLUSTER, PREFILL_HEADER


@dataclass(frozen=True, slots=True)
class DisaggPlan:
    prefill_pools: Mapping[str, frozenset[str]]
    """Model → its prefill pools (only models that have some)."""
    min_prompt_tokens: int

    @classmethod
    def from_config(cls, config: Config) -> DisaggPlan | None:
        """None when no pool is a prefill pool (nothing is ever split)."""
        pools: dict[str, set[str]] = {}
        for pool in config.pools:
            if pool.role == "prefill":
                pools.setdefault(pool.model, set()).add(pool.name)
        if not pools:
            return None
        return cls({model: frozenset(names) for model, names in pools.items()},
                   config.disaggregation.min_prompt_tokens)


@dataclass(frozen=True, slots=True)
class PairDecision:
    """A split request: its prefill and its decode worker, each with its fallbacks."""

    prefill: Decision
    decode: Decision

    @property
    def routed(self) -> Decision:
        """What Envoy is told: the sidecar's cluster; the decode worker names the request in counts and logs."""
        decode = self.decode
        return Decision(worker_id=decode.worker_id, pool=decode.pool, cluster=PD_SIDECAR_CLUSTER,
                        endpoint=decode.endpoint, scores=decode.scores)

    def headers(self) -> tuple[tuple[str, str], ...]:
        return (PREFILL_HEADER, self.prefill.pin), (DECODE_HEADER, self.decode.pin)


def pick_pair(scheduler: Scheduler, request: PickRequest, context: PickContext,
              plan: DisaggPlan) -> PairDecision | Outcome:
    """The pair for a long prompt of a disaggregated model, else the scheduler's one pick (decode-capable
    pools only, for a disaggregated model)."""
    prefill_pools = plan.prefill_pools.get(request.model)
    if prefill_pools is None:
        return scheduler.pick(request, context)
    decode_request = replace(request, excluded_pools=request.excluded_pools | prefill_pools)
    decode = scheduler.pick(decode_request, context)
    if request.prompt_tokens < plan.min_prompt_tokens or not isinstance(decode, Decision):
        return decode
    allowed = prefill_pools if request.only_pools is None else request.only_pools & prefill_pools
    prefill = scheduler.pick(replace(request, output_tokens=1, only_pools=allowed), context)
    if isinstance(prefill, Decision):
        return PairDecision(prefill, decode)
    if isinstance(prefill, NoCapacity):
        return prefill  # prefill workers are busy: wait for one rather than stall the decode worker's streams
    return decode  # no prefill worker this request may use is ready: an ordinary request on the decode worker
