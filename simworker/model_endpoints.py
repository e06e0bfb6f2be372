"""The endpoints beyond chat and completions (Responses API, pooling, tokenizer, audio), installed on a
worker's app, and what their handlers share: the model check, admission (health, faults) and engine runs.

``install`` adds the routes the model kind serves and a gate that answers vLLM's refusal (400 ``The model
does not support … API``) on the endpoints it does not, chat and completions included for pooling models.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

from aiohttp import web
from aiohttp.typedefs import Middleware

from simworker.engine import EngineRequest, FinishReason
from simworker.model_tasks import ModelTasks
from simworker.protocol import ApiError
from simworker.server import Handler, WorkerApi, _json


def install(app: web.Application, api: WorkerApi, tasks: ModelTasks) -> None:
    from simworker import audio, pooling, responses_api, tokenize_api

    app.middlewares.append(_task_gate(tasks))
    tokenize_api.add_routes(app, api)
    if tasks.generates:
        responses_api.add_routes(app, api)
    if tasks.convert in ("embed", "classify"):
        pooling.add_routes(app, api, tasks)
    if tasks.transcription:
        audio.add_routes(app, api)


def _task_gate(tasks: ModelTasks) -> Middleware:
    @web.middleware
    async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
        refusal = tasks.refusal(request.path) if request.method == "POST" else None
        if refusal is not None:
            return _json(ApiError(400, refusal).body(), status=400)
        return await handler(request)

    return gate


def check_model(api: WorkerApi, model: str | None) -> str:
    """The served name, after vLLM's check of the ``model`` field (optional; a wrong one is a 404)."""
    served = api.config.model_name
    if model is not None and model != served:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    return served


async def admit(api: WorkerApi) -> None:
    """What every inference request goes through before the engine: health, crash counter, faults."""
    api.control.note_inference_request()
    if api.control.health == "dead":
        raise ApiError(500, "The engine is dead (simulated crash); restart the worker.")
    if api.control.health == "starting":
        raise ApiError(503, "The server is still starting.")
    faults = api.control.faults
    if faults.error_rate and api.rng.random() < faults.error_rate:
        raise ApiError(500, "simulated internal server error (fault injection)")
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
                raise ApiError(500, "the engine failed while serving this request")
            outputs.append(stream.finished.output_tokens)
        return outputs
    finally:
        for request_id in ids:
            api.driver.abort(request_id)
