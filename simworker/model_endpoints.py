"""The endpoints beyond chat and completions (Responses API, pooling, tokenizer, audio), installed on a
worker's app. What their handlers share (the model check, admission, engine runs) is ``endpoint_steps``.

``install`` adds the routes the model kind serves and a gate that answers vLLM's refusal (400 ``The model
does not support … API``) on the endpoints it does not, chat and completions included for pooling models.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Middleware

from simworker import audio, pooling, responses_api, tokenize_api
from simworker.model_tasks import ModelTasks
from simworker.protocol import WorkerApiError
from simworker.server import Handler, WorkerApi, _json


def install(app: web.Application, api: WorkerApi, tasks: ModelTasks) -> None:
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
            return _json(WorkerApiError(400, refusal).body(), status=400)
        return await handler(request)

    return gate
