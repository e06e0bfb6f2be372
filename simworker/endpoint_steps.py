"""What the handlers of the endpoints beyond chat and completions share: vLLM's model check, admission
(health, crash counter, faults) and engine runs. Imports no endpoint module (``model_endpoints`` installs them).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

from simworker.engine import EngineRequest, FinishReason
from simworker.protocol import WorkerApiError
from simworker.server import WorkerApi


def check_model(api: WorkerApi, model: str | None) -> str:
    """The served name, after vLLM's check of the ``model`` field (optional; a wrong one is a 404)."""
    served = api.config.model_name
    if model is not None and model != served:
        raise WorkerApiError(404, f"The model `{model}` does not exist.", "model")
    return served


async def admit(api: WorkerApi) -> None:
    """What every inference request goes through before the engine: health, crash counter, faults."""
    api.control.note_inference_request()
    if api.control.health == "dead":
        raise WorkerApiError(500, "The engine is dead (simulated crash); restart the worker.")
    if api.control.health == "starting":
        raise WorkerApiError(503, "The server is still starting.")
    faults = api.control.faults
    if faults.error_rate and api.rng.random() < faults.error_rate:
        raise WorkerApiError(500, "simulated internal server error (fault injection)")
    if faults.added_latency_s:
        await asyncio.sleep(faults.added_latency_s)


async def run_to_completion(api: WorkerApi, prefix: str, jobs: Sequence[tuple[int, int]],
                            finish_reason: FinishReason = "stop") -> list[int]:
    """Run (prompt tokens, output tokens) jobs on the engine at once, as vLLM runs a batch of inputs, and
    wait for all; the output tokens each produced. A pooling input is one output token: its pooled state is
    read where a generative model samples its first token, so it costs a prefill and no decode step."""
    ids = [f"{prefix}-{uuid.uuid4().hex}" for _ in jobs]
    streams = [api.driver.submit(EngineRequest(request_id=request_id, prompt_tokens=prompt, output_target=output,
                                               finish_reason_at_target=finish_reason))
               for request_id, (prompt, output) in zip(ids, jobs, strict=True)]
    try:
        outputs: list[int] = []
        for stream in streams:
            while stream.finished is None:
                await stream.wait_change()
            if stream.finished.reason == "error":
                raise WorkerApiError(500, "the engine failed while serving this request")
            outputs.append(stream.finished.output_tokens)
        return outputs
    finally:
        for request_id in ids:
            api.driver.abort(request_id)
