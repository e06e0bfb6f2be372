"""``/v1/audio/transcriptions`` and ``/v1/audio/translations`` as vLLM serves them for speech-to-text models
(``--transcription`` here): a multipart form with the audio ``file`` and ``model``, ``language``, ``prompt``,
``response_format`` (``json`` or ``text``), ``stream``; the answer ``{"text", "usage": {"type": "duration",
"seconds"}}``, or with ``stream=true`` ``transcription.chunk`` / ``translation.chunk`` events and ``[DONE]``.

The cost follows Whisper's shape: audio is cut in 30 s chunks, each an engine request whose prompt is the
encoder's 1500 positions plus 4 task tokens and whose output is about 3 tokens per second of speech (capped at
448, Whisper's decoder length). A WAV file's duration comes from its header; any other format is assumed to
be 128 kbit/s (16,000 bytes per second).
"""

from __future__ import annotations

import math
import struct
import time
import uuid
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import BodyPartReader, web

from simworker import protocol, tokens
from simworker.model_endpoints import admit, check_model, run_to_completion
from simworker.protocol import ApiError
from simworker.server import WorkerApi, _json

CHUNK_S = 30.0
ENCODER_POSITIONS_PER_CHUNK = 1500
TASK_TOKENS = 4
OUTPUT_TOKENS_PER_S = 3.0
MAX_OUTPUT_PER_CHUNK = 448
COMPRESSED_BYTES_PER_S = 16_000
MAX_FILE_BYTES = 25 * 1024 * 1024
"""vLLM's ``VLLM_MAX_AUDIO_CLIP_FILESIZE_MB`` default."""


def audio_duration_s(data: bytes) -> float:
    """Seconds of audio: from a RIFF/WAVE header's byte rate and data size, else by the compressed rate."""
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        offset, byte_rate = 12, 0
        while offset + 8 <= len(data):
            chunk_id, size = data[offset:offset + 4], struct.unpack_from("<I", data, offset + 4)[0]
            if chunk_id == b"fmt " and size >= 16:
                byte_rate = struct.unpack_from("<I", data, offset + 16)[0]
            elif chunk_id == b"data" and byte_rate:
                return min(size, len(data) - offset - 8) / byte_rate
            offset += 8 + size + (size & 1)
    return len(data) / COMPRESSED_BYTES_PER_S


def chunk_jobs(duration_s: float) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of each 30 s chunk."""
    chunks = max(1, math.ceil(duration_s / CHUNK_S))
    jobs = []
    for index in range(chunks):
        seconds = min(CHUNK_S, duration_s - index * CHUNK_S)
        output = max(1, min(MAX_OUTPUT_PER_CHUNK, math.ceil(seconds * OUTPUT_TOKENS_PER_S)))
        jobs.append((ENCODER_POSITIONS_PER_CHUNK + TASK_TOKENS, output))
    return jobs


async def read_form(request: web.Request) -> tuple[bytes, dict[str, str]]:
    """The ``file`` part's bytes and the text fields; 400 for a body that is not a multipart form with a file."""
    if not request.content_type.startswith("multipart/form-data"):
        raise ApiError(400, "the request must be multipart/form-data with an audio 'file'", "file")
    reader = await request.multipart()
    audio: bytes | None = None
    fields: dict[str, str] = {}
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader) or part.name is None:
            continue
        if part.name == "file":
            audio = bytes(await part.read())
            if len(audio) > MAX_FILE_BYTES:
                raise ApiError(400, "Maximum file size exceeded.", "file")
        else:
            fields[part.name] = (await part.read()).decode("utf-8", "replace")
    if not audio:
        raise ApiError(400, "'file' is required: an audio file as a form part", "file")
    return audio, fields


def _endpoint(api: WorkerApi, task: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    prefix, chunk_object = ("trsc", "transcription.chunk") if task == "transcription" else ("trsl",
                                                                                              "translation.chunk")

    async def handle(request: web.Request) -> web.StreamResponse:
        audio, fields = await read_form(request)
        model = check_model(api, fields.get("model"))
        response_format = fields.get("response_format", "json")
        if response_format not in ("json", "text"):
            raise ApiError(400, "Currently only support response_format `text` or `json`", "response_format")
        duration = audio_duration_s(audio)
        await admit(api)
        outputs = await run_to_completion(api, prefix, chunk_jobs(duration))
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
