"""The ``scheduling`` section: task classes and the resource-aware picker's weights and bounds (extproc)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from poolgate.kernel.config.base import Section

TaskClass = Literal["short_chat", "long_context", "code_completion", "streaming"]


class TaskClassRules(Section):
    """How a request's task class is decided, first match wins: streaming with a long expected output →
    ``streaming``; prompt ≥ ``long_context_min_tokens`` → ``long_context``; a model in ``code_models`` →
    ``code_completion``; otherwise ``short_chat``. Token counts are extproc's estimates."""

    long_context_min_tokens: int = Field(8000, gt=0)
    streaming_min_output_tokens: int = Field(512, gt=0)
    code_models: tuple[str, ...] = ()


MAX_WAIT_LIMIT_S = 50.0
"""Longest hold for capacity allowed (Envoy's ext_proc ``max_message_timeout``, 300 s, bounds every hold; a
client waiting longer than this for a busy fleet is better told to retry)."""


class LearnedOutputSettings(Section):
    """Expected output from the lengths extproc reads in responses' usage, per model and task class (and
    tenant once it has enough of its own): the ``quantile`` of the recent ``window``, never above
    ``max_tokens``; it sizes KV reservations and decode room instead of the cap."""

    enabled: bool = True
    quantile: float = Field(0.95, gt=0, le=1)
    window: int = Field(1000, ge=10)
    min_samples: int = Field(50, ge=1)
    """Lengths of a model and class needed before they are used (until then: ``max_tokens`` or the default)."""
    tenant_min_samples: int = Field(200, ge=1)
    sample_every: int = Field(0, ge=0)
    """Also read the usage of one response in this many (every one until ``min_samples`` lengths are known);
    0 = learn only from the responses extproc reads anyway (quota reconciliation, GenAI metrics). Reading a
    response body costs ~30-70 µs of extproc CPU per streamed chunk."""


class SchedulingSettings(Section):
    """Weights and bounds of the resource-aware picker (extproc)."""

    weights: dict[str, float] | None = None
    """Scorer name → weight; scores are in [0, 1] and combine as a weighted sum. A missing name weighs 0.
    Not set: each scorer's default weight (the scheduling plugins' table below). By default one scorer
    decides, ``latency`` (each worker's predicted time to first token: prefill queued there, this prompt's
    uncached part, what it would evict, requests in flight), and ``lora_affinity`` speaks only for requests
    that name a LoRA adapter (an adapter swap stalls the batch). The older scorers stay available by name,
    at weight 0. Names are checked against extproc's plugin registry (``poolgate config check``, extproc's
    start-up)."""
    scorer_settings: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Scorer name → that scorer's own parameters, validated by the scorer (the scheduling plugins below)."""
    filter_settings: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Filter name → that filter's own parameters, validated by the filter (the scheduling plugins below)."""
    default_prefill_tokens_per_s: float = Field(8000.0, gt=0)
    """Prefill rate assumed for a worker that has not reported one yet."""
    default_output_tokens: int = Field(256, gt=0)
    """Expected output when the request sets no max_tokens (reported usage does not feed back into it)."""
    gpu_memory_min_free_mib: float = Field(0.0, ge=0)
    """GPU memory watermark: workers reporting less free memory than this are not picked (0 = off)."""
    kv_reserve_fraction: float = Field(0.02, ge=0, lt=1)
    """KV capacity kept free as a safety margin when checking that a request's footprint fits."""
    tokenizer_path: str | None = None
    """Local model directory with ``tokenizer.json`` (needs the ``tokenizers`` package); default is the fast
    character-based estimate."""
    chars_per_token: float = Field(4.0, gt=0.5, le=16)
    """The fast estimate's characters per prompt token (BPE tokenizers: about 4 on English prose)."""
    debug_header: bool = False
    """Add ``x-poolgate-decision`` (worker, task class, token estimates and scores) to the upstream request.
    Off in production: it tells the worker how it was chosen."""
    max_wait_s: float = Field(5.0, ge=0, le=MAX_WAIT_LIMIT_S)
    """How long a request that fits on no worker now is held, re-picking as capacity frees, before the answer
    is 429 with Retry-After (0 = answer at once)."""
    retry_after_s: int = Field(1, ge=1, le=3600)
    """The Retry-After sent with a 503 (no ready worker) or a 429 (no capacity)."""
    ttft_reference_s: float = Field(0.5, gt=0)
    """Predicted time to first token that scores 0.5 (score = t_ref / (t_ref + t))."""
    reservation_settle_s: float = Field(0.5, ge=0)
    """A placement counts as seen by the agent once the worker's record is this much newer than it."""
    prefix_chunk_chars: int = Field(256, ge=16)
    """Prompt-prefix affinity hashes the prompt in chunks of this many characters."""
    prefix_max_chunks: int = Field(32, ge=1, le=1024)
    """Only the first this many chunks of a prompt count for affinity (bounds the hashing per request)."""
    affinity_max_entries: int = Field(50_000, ge=0)
    """Size of the affinity map (session or prefix → worker), least recently used out first (0 = off)."""
    task_classes: TaskClassRules = TaskClassRules()
    learned_output: LearnedOutputSettings = LearnedOutputSettings()
    max_inflight_per_worker: int = Field(0, ge=0)
    """Saturation gate: a worker whose load, max(running + waiting, extproc's in-flight), reaches this takes no
    more requests; they wait in the priority queue, served class by class (0 = off)."""
    lower_class_inflight_fraction: float = Field(1.0, gt=0, le=1)
    """Classes below the highest may fill a worker only to this fraction of ``max_inflight_per_worker``; the
    rest is headroom the highest class finds free when lower classes burst (1 = no headroom)."""
    max_prefill_backlog_s: float = Field(0.0, ge=0, le=MAX_WAIT_LIMIT_S)
    """Prefill-backlog gate: a worker whose predicted queued prefill exceeds this many seconds (plus what the
    request has already waited) takes no new request; it waits in the priority queue, where short and urgent
    requests go first, instead of in the engine's FIFO queue (0 = off)."""
    queue_when_waiting: bool = False
    """Classes below the highest are not placed on a worker whose engine reports waiting requests (it is full:
    they would queue there, out of priority order)."""

    @field_validator("weights")
    @classmethod
    def _no_negative_weight(cls, weights: dict[str, float] | None) -> dict[str, float] | None:
        negative = sorted(name for name, weight in (weights or {}).items() if weight < 0)
        if negative:
            raise ValueError(f"{', '.join(negative)} must be 0 or more")
        return weights
