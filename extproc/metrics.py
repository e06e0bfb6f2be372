"""extproc's Prometheus metrics, registered on an injected registry (no process-wide singletons).

Besides poolgate's own series, four histograms carry the OpenTelemetry GenAI semantic conventions under
their Prometheus names (dots become underscores, unit ``s`` adds ``_seconds``, the ``{token}`` annotation
adds nothing) with the conventions' bucket boundaries; ``genai`` records them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

GENAI_LABELS = ("gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "gen_ai_response_model")
"""The semantic conventions' attributes every GenAI histogram here carries, in this order."""
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
REQUEST_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "poolgate_extproc_requests", "Requests handled, by outcome (routed, passthrough, model_list or an "
            "error code)", ["outcome"], registry=self.registry)
        self.pick_seconds = Histogram(
            "poolgate_extproc_pick_seconds", "Decision time: the scheduler's pick over the snapshot",
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2), registry=self.registry)
        self.picks = Counter(
            "poolgate_extproc_picks", "Requests placed, by pool and worker", ["pool", "worker"],
            registry=self.registry)
        self.pick_refusals = Counter(
            "poolgate_extproc_pick_refusals", "Picks that found no worker, by model and the filter that left "
            "none (kv-fits and gpu-memory are no-capacity refusals a request may wait out)", ["model", "reason"],
            registry=self.registry)
        self.held_requests = Gauge(
            "poolgate_extproc_held_requests", "Requests held now, waiting for KV or GPU capacity",
            registry=self.registry)
        self.hold_seconds = Histogram(
            "poolgate_extproc_hold_seconds",
            "Time requests were held for capacity, by outcome (placed, refused, cancelled)",
            ["outcome"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=self.registry)
        self.cold_start_seconds = Histogram(
            "poolgate_extproc_cold_start_wait_seconds", "Time requests for a pool scaled to zero waited for its "
            "first worker, by model and outcome (placed, refused: past the pool's cold_start_wait_s, cancelled)",
            ["model", "outcome"], buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 90, 120, 180, 290), registry=self.registry)
        self.queue_depth = Gauge(
            "poolgate_extproc_queue_depth", "Requests waiting in the priority queue, by class and tenant",
            ["priority_class", "tenant"], registry=self.registry)
        self.queue_wait_seconds = Histogram(
            "poolgate_extproc_queue_wait_seconds", "Time requests waited in the priority queue, by class and "
            "outcome (placed, refused, shed, cancelled)", ["priority_class", "outcome"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=self.registry)
        self.admissions = Counter(
            "poolgate_extproc_admissions", "Inference requests admitted (quota passed), by tenant and class",
            ["tenant", "priority_class"], registry=self.registry)
        self.rejections = Counter(
            "poolgate_extproc_rejections", "Requests refused before or while waiting, by tenant and reason "
            "(invalid_api_key, model_not_allowed, max_concurrent, requests_per_minute, tokens_per_minute, "
            "queue_deadline, queue_full, quota_unavailable)", ["tenant", "reason"], registry=self.registry)
        self.quota_errors = Counter(
            "poolgate_extproc_quota_errors", "Quota calls to Redis that failed (admission fails open or closed "
            "per tenancy.quota_fail_open; a failed release leaves the slot to its lease)", ["call"],
            registry=self.registry)
        self.quota_deferred_charges = Counter(
            "poolgate_extproc_quota_deferred_charges", "Fail-open admissions whose quota charge was kept while "
            "Redis was away (kept), written once it answered (written) or dropped unwritten after minutes (expired)",
            ["outcome"], registry=self.registry)
        self.usage_reconciled = Counter(
            "poolgate_extproc_usage_reconciled", "Requests whose token charge was corrected from the reported "
            "usage (observed) or kept as the estimate (estimated)", ["result"], registry=self.registry)
        self.internal_errors = Counter(
            "poolgate_extproc_internal_errors", "Unexpected exceptions on the request path (answered 500)",
            registry=self.registry)
        self.open_streams = Gauge(
            "poolgate_extproc_open_streams", "ext_proc streams currently open", registry=self.registry)
        self.snapshot_age_seconds = Gauge(
            "poolgate_extproc_snapshot_age_seconds", "Age of the fleet snapshot picks are made on",
            registry=self.registry)
        self.redis_up = Gauge(
            "poolgate_extproc_redis_up", "1 when the last Redis refresh succeeded, 0 when serving a kept snapshot",
            registry=self.registry)
        self.stale_workers = Gauge(
            "poolgate_extproc_stale_workers", "Workers in the snapshot whose live state is too old to pick",
            registry=self.registry)
        self.workers = Gauge("poolgate_extproc_workers", "Workers in the snapshot", registry=self.registry)
        self.kv_event_streams = Gauge(
            "poolgate_extproc_kv_event_streams", "Workers' KV-event subscriptions by state: known (in sync, picks "
            "use the exact cached prefix) or unknown (gone, behind or relearning: the estimate stands in)",
            ["state"], registry=self.registry)
        self.kv_index_blocks = Gauge(
            "poolgate_extproc_kv_index_blocks", "(worker, block) entries in the KV-event index",
            registry=self.registry)
        self.kv_event_gaps = Counter(
            "poolgate_extproc_kv_event_gaps", "Gaps in workers' KV-event streams, by outcome: replayed (the "
            "missed batches were fetched) or lost (history gone: the worker relearns)", ["outcome"],
            registry=self.registry)
        self.token_usage = Histogram(
            "gen_ai_client_token_usage", "Tokens per inference request as the worker reported them in its usage "
            "block, by gen_ai_token_type (input, output); requests without a reported usage are not counted "
            "(OpenTelemetry gen_ai.client.token.usage)", [*GENAI_LABELS, "gen_ai_token_type"],
            buckets=TOKEN_BUCKETS, registry=self.registry)
        self.request_duration = Histogram(
            "gen_ai_server_request_duration_seconds", "Inference request duration, from extproc seeing the "
            "request headers to the last response byte (or to extproc's own error answer); error_type is set "
            "when it failed: extproc's error code, the worker's HTTP status, stream_error or incomplete "
            "(OpenTelemetry gen_ai.server.request.duration)", [*GENAI_LABELS, "error_type"],
            buckets=REQUEST_DURATION_BUCKETS, registry=self.registry)
        self.time_to_first_token = Histogram(
            "gen_ai_server_time_to_first_token_seconds", "Streamed requests that succeeded: from extproc seeing "
            "the request headers to the first response chunk carrying output, so it includes poolgate's queueing "
            "and holding for capacity as well as the engine's queue and prefill "
            "(OpenTelemetry gen_ai.server.time_to_first_token)", GENAI_LABELS,
            buckets=TIME_TO_FIRST_TOKEN_BUCKETS, registry=self.registry)
        self.time_per_output_token = Histogram(
            "gen_ai_server_time_per_output_token_seconds", "Streamed requests that succeeded with two or more "
            "output tokens: (last chunk - first output chunk) / (output tokens - 1) "
            "(OpenTelemetry gen_ai.server.time_per_output_token)", GENAI_LABELS,
            buckets=TIME_PER_OUTPUT_TOKEN_BUCKETS, registry=self.registry)
