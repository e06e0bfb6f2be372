"""Predicted time to first token, in seconds, from what each worker must compute before this request's
first token: the one latency model the pick minimises.

For each candidate w, with P the prompt's tokens and c_w the tokens of its leading blocks w's cache holds:

    U_w = P − c_w                 this request's own prefill there
    c_w = the KV index's cached prefix (w's event stream in sync), else s_w × P with s_w the affinity
          strength (``prefix_affinity``: where this session or prefix went last): an unknown worker may hold
          anything, but is never assumed empty or full
    Q_w = max(queued_w, latest_w(waiting_w))
          queued_w: the prefill placed on w, by this replica and (as the exchange brings them) the others,
          drained at w's rate (``extproc/prefill_ledger.py``; ``PickContext.pending_prefill_tokens``);
          latest_w(n) stands in for a queue the ledger does not know (requests that came another way, a
          drain faster than the engine's): the prefill of the latest n requests placed on w, by this replica
          and the others as the exchange brings them (``PickContext.latest_prefill``), since the engine serves
          in order and the waiting_w requests it reports are its latest arrivals; waiting_w × U_w before any
          placement there is known. Charging
          each waiting request at this prompt's size made fifteen queued questions about a cached document
          cost fifteen documents, and a cold start's new documents all went to the workers already
          prefilling documents (the lab, median over five traces of the p99 over the best peer's: the H100
          mix 0.97-1.02× where it was 0.99-1.22×, its goodput still at least the peers'; H100 shared documents
          with bursts at 85 % 1.09 → 0.99×, on Poisson 0.82 → 0.87×; ``docs/results/lab-2026-12-06``)
    R_w = the fastest prefill rate ever measured (``agent.rates``: computed prompt tokens per second of
          prefill time) among the model's workers of w's kind (same KV capacity and GPU memory: the same card
          serving the same model), or ``scheduling.default_prefill_tokens_per_s`` while none is known
          (``scheduling.rates``). A request's prefill shares its steps with the others' chunks and decodes, and
          lasts at least one step however few tokens it computes, so each worker's figure falls below what
          its hardware does, by how busy it happened to be and how much of its prompts was cached; the best
          its kind has shown is the hardware's. Taking each worker's own would make the worker that served
          the most cached prompts look slow and lose the cold ones it could take (measured in the lab:
          identical L4s read 730-2,700 tokens/s at once); taking the kind's best at the moment fails when
          every engine of the kind serves cached prompts (three H100s on shared documents read 27,000
          tokens/s at the start and 900 a minute later), and the ledger then kept a cold prompt queued 30×
          too long (the lab, H100s, shared documents at 85 %: p99 0.436 s with the moment's best, 0.362 s
          with the best ever).
    E_w = max(0, U_w + O − free_w)     the cached tokens this request would evict there: its KV (prompt
          part not cached there, expected output O) beyond the room no block holds, free_w = capacity ×
          (1 − usage) less what the index says the cache keeps for reuse (an unknown stream: usage only)
    S_w = the shortest engine step w's kind has shown (``scheduling.rates``: the least inter-token gap of its
          records; 0 while none is known): a first token comes at the end of a step, and each step reads the
          model's weights once, so a slow card answers no sooner than its step however little it computes
    t(w) = (Q_w + U_w + λ_w × E_w + K × n_w) / R_w + S_w − min over the candidates of S

where n_w is the requests in flight on w (all replicas) and K = ``INFLIGHT_TOKENS`` (the setting
``scheduling.scorer_settings.latency.inflight_tokens``): each request there takes its share of every engine
step this prefill runs in (vLLM batches decodes with the prefill chunks), and is slowed by it in turn, so
between two workers with the same prefill ahead the one with fewer streams answers sooner and harms fewer.
Counted in prefill tokens, it weighs alike on fast and slow cards.

λ_w = w's prefix-cache hit rate (``agent.rates``; ``EVICTION_WEIGHT``, the setting ``eviction_weight``, while
unknown): an evicted block is a prefix some later request might have found, and would then prefill again; how
likely that is, the share of prompt tokens w's cache has been serving says. Without this term a new prefix
goes to any idle worker and pushes out the prefixes that worker is warm for; with it, a new prefix goes where
it displaces least, as the cache-aware routers' "smallest tree" rule does, but weighed against the queue (the
lab, six L4s, shared documents at 85 %: p99 2.09 s and hit rate 0.954 without it, 1.93 s and 0.967 with it).

The step term is what tells a warm slow card from a cold fast one: a session's next turn on the L4 that holds
its history computes a hundred tokens, on an idle H100 a thousand, and by throughput alone the two are even,
but the L4 answers after its ~70-ms step and the H100 after ~8 ms plus the prefill (the lab's mixed fleet,
sessions at 50 %: sessions that began on an L4 stayed there for all their turns, and the p99 was 0.063 s or
0.096 s as the first pick's tie fell; see ``scheduling.rates``). Among workers of one kind it is the same for all
and cancels, so a homogeneous fleet's picks do not change.

The engine is FCFS: everything queued before the request is computed before it, so the prefill ahead is the
ledger's sum, in tokens, not the number of requests times this request's size. A warm worker's queue is then
as long as what was really placed there.

score(w) = (t_min + ε) / (t(w) + ε), with t_min the best candidate's and ε = ``FLOOR_S`` (about one engine
step, below which predictions do not differ): 1 for the best, and the picker's tolerance (1 % of the full
score) makes candidates within about 1 % of the best prediction equal, chosen at random.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

from pydantic import Field

from extproc.scheduling.plugins import PickContext, PickRequest, SameScore, ScorerPlugin
from extproc.scheduling.rates import KindRates
from extproc.scheduling.scorers.prefix_affinity import PrefixAffinity
from poolgate.kernel.config import Section
from poolgate.kernel.fleet import WorkerRecord

EVICTION_WEIGHT = 1.0
"""λ for a worker whose hit rate is not known yet: count every evicted token as one to prefill again."""
INFLIGHT_TOKENS = 100
"""Prefill tokens of work a request in flight on a worker counts for. The lab on the L4 fleet at 85 %: 100
gave the best p99 on sessions (0.57 s; 200: 0.67 s, 1,000: 2.36 s, where balance outweighed the cached
system prompts) at no loss on the mix (5.79 s; 1,000: 5.77 s) or shared documents (1.93 s)."""
FLOOR_S = 0.02
_NONE_CACHED: Mapping[str, int] = MappingProxyType({})


class PredictedLatency:
    name = "latency"

    def __init__(self, default_prefill_tokens_per_s: float, inflight_tokens: float = INFLIGHT_TOKENS,
                 eviction_weight: float = EVICTION_WEIGHT) -> None:
        self.default_rate = default_prefill_tokens_per_s
        self.inflight_tokens = inflight_tokens
        self.eviction_weight = eviction_weight
        self._affinity = PrefixAffinity()
        self._rates_of: object = None
        self._observed: set[str] = set()
        self._rates = KindRates(default_prefill_tokens_per_s)

    def seconds(self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext) -> list[float]:
        """t(w) for each candidate, in their order (one pass after the rates; the pick's hot loop)."""
        blocks, view = request.prompt_blocks, context.prefix_cache
        prompt = blocks.token_count if blocks is not None else request.prompt_tokens
        cached: Mapping[str, int] = (view.cached_tokens(blocks, candidates) if blocks is not None and view is not None
                                     else _NONE_CACHED)
        if len(cached) == len(candidates):
            strengths: Sequence[float] = SameScore(len(candidates))  # every cache known: no estimate needed
        else:
            strengths = self._affinity.score(request, candidates, context)
        uniform = strengths.value if isinstance(strengths, SameScore) else None
        self._observe_rates(context, request.model, candidates)
        rate_and_step = self._rates.rate_and_step
        queued = context.pending_prefill_tokens.get
        latest = context.latest_prefill.latest_tokens if context.latest_prefill is not None else None
        inflight = context.inflight.get
        hit_of = cached.get
        held_of = view.held_tokens if view is not None else None
        per_request = self.inflight_tokens
        weight = self.eviction_weight
        output = request.output_tokens
        seconds: list[float] = []
        steps: list[float] = []
        for index, worker in enumerate(candidates):
            worker_id = worker.id
            hit = hit_of(worker_id)
            if hit is None:
                hit = int((uniform if uniform is not None else strengths[index]) * prompt)
            own = prompt - hit
            ahead = queued(worker_id, 0)
            count = worker.waiting
            if count:
                known = latest(worker_id, count) if latest is not None else None
                waiting = count * own if known is None else known
                if waiting > ahead:
                    ahead = waiting
            work = ahead + own + per_request * inflight(worker_id, 0)
            capacity = worker.kv_capacity_tokens
            reuse = worker.prefix_cache_hit_rate
            if reuse < 0:
                reuse = weight
            if reuse and capacity:
                occupied = capacity * worker.kv_usage
                if held_of is not None:
                    held = held_of(worker)
                    if held is not None and held > occupied:
                        occupied = held
                evicted = own + output - (capacity - occupied)
                if evicted > 0:
                    work += reuse * evicted
            rate, step = rate_and_step(worker)
            seconds.append(work / rate)
            steps.append(step)
        fastest = min(steps, default=0.0)
        if max(steps, default=0.0) > fastest:  # kinds differ (else the term cancels)
            seconds = [t + step - fastest for t, step in zip(seconds, steps, strict=True)]
        return seconds

    def _observe_rates(self, context: PickContext, model: str, candidates: Sequence[WorkerRecord]) -> None:
        """Fold the model's ready workers into the kinds' peak rates, once per snapshot and model (the pick's
        candidates are among them)."""
        snapshot = context.snapshot
        if snapshot is not self._rates_of:
            self._rates_of, self._observed = snapshot, set()
        if model not in self._observed:
            self._observed.add(model)
            self._rates.observe(snapshot.ready_workers_for(model))
            self._rates.observe(candidates)

    def score(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[float]:
        seconds = self.seconds(request, candidates, context)
        best = min(seconds) + FLOOR_S
        return [best / (t + FLOOR_S) for t in seconds]


class LatencySettings(Section):
    """The latency scorer's own constants, K and λ of its formula (``extproc/scheduling/scorers/latency.py``)."""

    inflight_tokens: float = Field(INFLIGHT_TOKENS, ge=0)
    """K: the prefill tokens of work each request in flight on a worker counts for."""
    eviction_weight: float = Field(EVICTION_WEIGHT, ge=0)
    """λ for a worker whose prefix-cache hit rate is not known yet (tokens to prefill again per evicted one)."""


PLUGIN: ScorerPlugin[LatencySettings] = ScorerPlugin(
    "latency",
    lambda own, shared: PredictedLatency(shared.default_prefill_tokens_per_s, own.inflight_tokens, own.eviction_weight),
    LatencySettings, default_weight=1.0)
