"""Handlers of the pooling endpoints: ``/v1/embeddings``, ``/score`` (and ``/v1/score``), ``/rerank`` (and
``/v1/rerank``, ``/v2/rerank``), on a worker started with ``--runner pooling``.

Every input (or, for a cross-encoder, every query-document pair) is one engine request that costs its
prefill and nothing else; an embedding model scores by embedding each text once.
"""

from __future__ import annotations

from aiohttp import web

from simworker import pooling_protocol as wire
from simworker.endpoint_steps import admit, check_model, run_to_completion
from simworker.model_tasks import ModelTasks
from simworker.server import WorkerApi, _json, _read_json

SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")


class PoolingEndpoints:
    def __init__(self, api: WorkerApi, tasks: ModelTasks) -> None:
        self.api = api
        self.tasks = tasks

    async def embeddings(self, request: web.Request) -> web.Response:
        api = self.api
        parsed = wire.parse_embeddings(await _read_json(request), self.tasks.embedding_dim)
        model = check_model(api, parsed.model)
        wire.check_lengths(parsed.inputs, api.config.max_model_len)
        await admit(api)
        await run_to_completion(api, "embd", [(len(tokens), 1) for tokens in parsed.inputs])
        vectors = [wire.truncated(wire.embed(tokens, self.tasks.embedding_dim), parsed.dimensions)
                   for tokens in parsed.inputs]
        return _json(wire.embedding_response(model, vectors, parsed.base64, sum(map(len, parsed.inputs))))

    async def score(self, request: web.Request) -> web.Response:
        parsed = wire.parse_score(await _read_json(request))
        model = check_model(self.api, parsed.model)
        scores, prompt_tokens = await self._scores(parsed)
        return _json(wire.score_response(model, scores, prompt_tokens))

    async def rerank(self, request: web.Request) -> web.Response:
        parsed = wire.parse_rerank(await _read_json(request))
        model = check_model(self.api, parsed.model)
        scores, prompt_tokens = await self._scores(parsed)
        return _json(wire.rerank_response(model, parsed, scores, prompt_tokens))

    async def _scores(self, parsed: wire.ScoreRequest) -> tuple[list[float], int]:
        """An embedding model embeds each distinct text once and compares by cosine; a cross-encoder reads
        each pair as one sequence."""
        api, dim = self.api, self.tasks.embedding_dim
        if self.tasks.convert == "embed":
            distinct = list(dict.fromkeys(text for pair in parsed.pairs for text in pair))
            wire.check_lengths(distinct, api.config.max_model_len)
            await admit(api)
            await run_to_completion(api, "score", [(len(text), 1) for text in distinct])
            vectors = {text: wire.embed(text, dim) for text in distinct}
            scores = [wire.cosine(vectors[a], vectors[b]) for a, b in parsed.pairs]
            return scores, sum(map(len, distinct))
        joined = [first + second for first, second in parsed.pairs]
        wire.check_lengths(joined, api.config.max_model_len)
        await admit(api)
        await run_to_completion(api, "score", [(len(pair), 1) for pair in joined])
        scores = [(1 + wire.cosine(wire.embed(a, dim), wire.embed(b, dim))) / 2 for a, b in parsed.pairs]
        return scores, sum(map(len, joined))


def add_routes(app: web.Application, api: WorkerApi, tasks: ModelTasks) -> None:
    endpoints = PoolingEndpoints(api, tasks)
    app.router.add_post("/v1/embeddings", endpoints.embeddings)
    for path in SCORE_PATHS:
        app.router.add_post(path, endpoints.score)
    for path in RERANK_PATHS:
        app.router.add_post(path, endpoints.rerank)
