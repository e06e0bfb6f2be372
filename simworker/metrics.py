"""Prometheus series of one simulated worker, named and labelled as vLLM V1 names them.

Each worker owns its ``CollectorRegistry`` (several workers share a process). Engine series carry
``engine="0"`` and ``model_name`` (the served name). Counters are declared without ``_total``;
prometheus_client adds it (and the ``_created`` sibling vLLM also shows). Bucket boundaries are
vLLM's. Series that only a simulator has are prefixed ``poolgate_sim_``: a stand-in for NVML
(memory, utilization) and the driver's lag behind its own model, which says whether the host CPU
keeps up with the modelled GPU.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from simworker.engine import FinishReason, RequestFinished, StepOutcome

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0)
"""vLLM's buckets for ``vllm:inter_token_latency_seconds``."""
STEP_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "abort", "error")
ENGINE_LABELS = ("engine", "model_name")


class WorkerMetrics:
    """vLLM's series as an engine that runs ``time_scale`` × the modelled GPU's speed would report them: its
    latencies in real seconds. The router reads them against its own clock (a stream's decode room shrinks by
    the inter-token gap, the prefill ledger drains at the measured rate), so a simulated worker slowed five
    times must say so in its metrics, as a slower GPU would; the engine's model-time figures are divided by
    ``time_scale``, and a step's inter-token gap is the real time it took (the host's lag included)."""

    def __init__(self, model_name: str, cache_config: dict[str, str], gpu_memory_total_bytes: float,
                 legacy_kv_metric: bool, time_scale: float = 1.0) -> None:
        self.real_s_per_model_s = 1.0 / time_scale  # > 0: the driver refuses any other
        self.registry = CollectorRegistry()
        labels = {"engine": "0", "model_name": model_name}
        registry = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ENGINE_LABELS, registry=registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ENGINE_LABELS, registry=registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ENGINE_LABELS, buckets=buckets, registry=registry).labels(**labels)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.legacy_kv_usage = (gauge("vllm:gpu_cache_usage_perc",
                                      "GPU KV-cache usage. 1 means 100 percent usage (deprecated name).")
                                if legacy_kv_metric else None)
        cache_labels = {**cache_config, **labels}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", sorted(cache_labels),
              registry=registry).labels(**cache_labels).set(1)
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ("engine", "finished_reason", "model_name"), registry=registry)
        self.success = {reason: success.labels(engine="0", finished_reason=reason, model_name=model_name)
                        for reason in FINISH_REASONS}
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token = histogram("vllm:inter_token_latency_seconds",
                                     "Histogram of inter-token latency in seconds.", INTER_TOKEN_BUCKETS)
        """One sample per output token after a request's first: the step that produced it (a running
        sequence gets a token every step), so a prefill sharing the step shows as a stall here."""
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.",
                                      REQUEST_LATENCY_BUCKETS)
        self._queued_for: dict[str, float] = {}
        """Request → its queue time, until its first token: prefill time = TTFT − queue time (as vLLM)."""

        Gauge("poolgate_sim_gpu_memory_total_bytes", "Simulated GPU memory of the card.",
              registry=registry).set(gpu_memory_total_bytes)
        self.gpu_memory_used = Gauge("poolgate_sim_gpu_memory_used_bytes",
                                     "Simulated GPU memory in use: weights plus KV blocks in use.",
                                     registry=registry)
        self.gpu_utilization = Gauge("poolgate_sim_gpu_utilization",
                                     "Share of the last second the simulated GPU spent in steps (0..1).",
                                     registry=registry)
        self.step_lag = Histogram("poolgate_sim_step_lag_seconds",
                                  "How late each simulated step ended versus its modelled end.",
                                  buckets=STEP_LAG_BUCKETS, registry=registry)
        self.modelled_step_seconds = Counter("poolgate_sim_modelled_step_seconds",
                                             "Real seconds the modelled steps should have taken (sum).",
                                             registry=registry)
        self.kv_leaked_blocks = Gauge("poolgate_sim_kv_leaked_blocks",
                                      "KV blocks lost to the leak fault.", registry=registry)

    def record_step(self, outcome: StepOutcome, real_step_s: float | None = None) -> None:
        """One engine step; ``real_step_s``: the real time it took (default: its modelled time, scaled)."""
        real = self.real_s_per_model_s
        if outcome.preemptions:
            self.preemptions.inc(outcome.preemptions)
        if outcome.prompt_tokens:
            self.prompt_tokens.inc(outcome.prompt_tokens)
        if outcome.generation_tokens:
            self.generation_tokens.inc(outcome.generation_tokens)
        if outcome.prefix_cache_queries:
            self.prefix_queries.inc(outcome.prefix_cache_queries)
            self.prefix_hits.inc(outcome.prefix_cache_hits)
        for request_id, queue_s in outcome.queue_times:
            self.queue_time.observe(queue_s * real)
            self._queued_for[request_id] = queue_s * real
        later_tokens = len(outcome.emitted) - len(outcome.first_token_times)
        step_s = real_step_s if real_step_s is not None else outcome.duration_s * real
        for _ in range(later_tokens):
            self.inter_token.observe(step_s)
        for request_id, model_ttft_s in outcome.first_token_times:
            ttft_s = model_ttft_s * real
            self.ttft.observe(ttft_s)
            if request_id in self._queued_for:
                self.prefill_time.observe(max(0.0, ttft_s - self._queued_for.pop(request_id)))
        for finished in outcome.finished:
            self.record_finished(finished)

    def record_finished(self, finished: RequestFinished) -> None:
        self._queued_for.pop(finished.request_id, 0.0)  # aborted before its first token
        self.success[finished.reason].inc()
        if finished.reason != "abort":
            self.e2e.observe(finished.e2e_s * self.real_s_per_model_s)

    def record_state(self, running: int, waiting: int, kv_usage: float, gpu_memory_used_bytes: float,
                     leaked_blocks: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        if self.legacy_kv_usage is not None:
            self.legacy_kv_usage.set(kv_usage)
        self.gpu_memory_used.set(gpu_memory_used_bytes)
        self.kv_leaked_blocks.set(leaked_blocks)

    def track_utilization(self, read_utilization: Callable[[], float]) -> None:
        self.gpu_utilization.set_function(read_utilization)
