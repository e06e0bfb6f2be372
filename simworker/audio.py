"""``/v1/audio/transcriptions`` and ``/v1/audio/translations`` as vLLM serves them for speech-to-text models
(``--transcription`` here): a multipart form with the audio ``file`` and ``model``, ``language``, ``prompt``,
``response_format`` (``json`` or ``text``), ``stream``; the answer ``{"text", "usage": {"type": "duration",
"seconds"}}``, or with ``stream=true`` ``transcription.chunk`` / ``translation.chunk`` events and ``[DONE]``.

The cost follows Whisper's shape (``poolgate.kernel.audio_clip``): one engine request per 30 s chunk, its
prompt the encoder's positions, its output about 3 tokens per second of speech.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import BodyPartReader, web

from poolgate.kernel.audio_clip import audio_duration_s, chunk_costs
from simworker import protocol, tokens
from simworker.endpoint_steps import admit, check_model, run_to_completion
from simworker.protocol import WorkerApiError
from simworker.server import WorkerApi, _json

MAX_FILE_BYTES = 25 * 1024 * 1024
"""vLLM's ``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB`` default."""


async def read_form(request: web.Request) -> tuple[bytes, dict[str, str]]:
    """The ``file`` part's bytes and the text fields; 400 for a body that is not a multipart form with a file."""
    if not request.content_type.startswith("multipart/form-data"):
        raise WorkerApiError(400, "the request must be multipart/form-data with an audio 'file'", "file")
    reader = await request.multipart()
    audio: bytes | None = None
    fields: dict[str, str] = {}
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader) or part.name is None:
            continue
        if part.name == "file":
            audio = bytes(await part.read())
            if len(audio) > MAX_FILE_BYTES:
                raise WorkerApiError(400, "Maximum file size exceeded.", "file")
        else:
            fields[part.name] = (await part.read()).decode("utf-8", "replace")
    if not audio:
        raise WorkerApiError(400, "'file' is required: an audio file as a form part", "file")
    return audio, fields


def _endpoint(api: WorkerApi, task: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    prefix, chunk_object = ("trsc", "transcription.chunk") if task == "transcription" else ("trsl",
                                                                                              "translation.chunk")

    async def handle(request: web.Request) -> web.StreamResponse:
        audio, fields = await read_form(request)
        model = check_model(api, fields.get("model"))
        response_format = fields.get("response_format", "json")
        if response_format not in ("json", "text"):
            raise WorkerApiError(400, "Currently only support response_format `text` or `json`", "response_format")
        duration = audio_duration_s(audio)
        await admit(api)
        outputs = await run_to_completion(api, prefix, chunk_costs(duration))
        seed = tokens.stable_hash(f"{len(audio)}:{audio[:64].hex()}")
        text = protocol.generated_text(seed, 0, sum(outputs)).strip()
        seconds = math.ceil(duration)
        if fields.get("stream", "false").lower() == "true":
            return await _stream(request, f"{prefix}-{uuid.uuid4().hex}", chunk_object, model, seed, sum(outputs),
                                 fields.get("stream_include_usage", "false").lower() == "true", seconds)
        if response_format == "text":
            return web.Response(text=text, content_type="text/plain")
        return _json({"text": text, "usage": {"type": "duration", "seconds": seconds}})

    return handle


async def _stream(request: web.Request, request_id: str, chunk_object: str, model: str, seed: int, count: int,
                  include_usage: bool, seconds: int) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    created = int(time.time())
    frames = []
    for index in range(count):
        finish = "stop" if index == count - 1 else None
        frames.append({"id": request_id, "object": chunk_object, "created": created, "model": model,
                       "choices": [{"delta": {"content": tokens.filler_token(seed, index)},
                                    "finish_reason": finish, "stop_reason": None}]})
    if include_usage:
        frames.append({"id": request_id, "object": chunk_object, "created": created, "model": model,
                       "choices": [], "usage": {"type": "duration", "seconds": seconds}})
    await response.write(b"".join(b"data: " + orjson.dumps(f) + b"\n\n" for f in frames) + b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def add_routes(app: web.Application, api: WorkerApi) -> None:
    app.router.add_post("/v1/audio/transcriptions", _endpoint(api, "transcription"))
    app.router.add_post("/v1/audio/translations", _endpoint(api, "translation"))
