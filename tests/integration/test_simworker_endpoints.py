"""The simulated worker's Responses API, pooling, tokenizer and audio endpoints over real HTTP, with vLLM's
shapes (checked through the openai SDK where it has a client) and vLLM's refusals by model kind."""

from __future__ import annotations

import io
import math
import struct
import wave
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest

from simworker.model_tasks import ModelTasks
from simworker.worker import SimWorker
from tests.conftest import StartSimWorker

StartWorker = Callable[..., Awaitable[SimWorker]]
EMBED = ModelTasks(runner="pooling", convert="embed", embedding_dim=64)
CROSS_ENCODER = ModelTasks(runner="pooling", convert="classify")
GENERATIVE = ModelTasks()


@pytest.fixture()
def start_worker(start_simworker: StartSimWorker) -> StartWorker:
    """A worker serving a model of the given kind (a generative one by default)."""
    async def start(tasks: ModelTasks = GENERATIVE, model: str = "sim-model", **overrides: Any) -> SimWorker:
        return await start_simworker(tasks=tasks, model_name=model, **overrides)

    return start


def url(worker: SimWorker, path: str = "") -> str:
    return f"http://127.0.0.1:{worker.spec.port}{path}"


def sdk(worker: SimWorker) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url(worker, "/v1"), api_key="unused", max_retries=0)


async def post(worker: SimWorker, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(url(worker, path), json=body) as response:
        return response.status, await response.json(content_type=None)


def wav_bytes(seconds: float, rate: int = 16_000) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(struct.pack("<h", 0) * int(seconds * rate))
    return buffer.getvalue()


async def test_embeddings_through_the_sdk_float_and_base64(start_worker: StartWorker) -> None:
    worker = await start_worker(EMBED, model="bge-sim")
    async with sdk(worker) as client:
        default = await client.embeddings.create(model="bge-sim", input=["the cat sat", "the cat sat down"])
        floats = await client.embeddings.create(model="bge-sim", input="the cat sat", encoding_format="float")
        short = await client.embeddings.create(model="bge-sim", input="the cat sat", dimensions=16)
    assert default.model == "bge-sim" and [d.index for d in default.data] == [0, 1]
    assert all(len(d.embedding) == 64 for d in default.data)  # the SDK asked base64 and decoded it
    assert default.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-6)
    assert math.fsum(x * x for x in floats.data[0].embedding) == pytest.approx(1.0)
    assert len(short.data[0].embedding) == 16
    assert default.usage.prompt_tokens == default.usage.total_tokens == 7


async def test_score_and_rerank_order_by_shared_words(start_worker: StartWorker) -> None:
    for tasks in (EMBED, CROSS_ENCODER):
        worker = await start_worker(tasks)
        status, score = await post(worker, "/score", {"text_1": "red apples", "text_2": ["red apples", "blue sky"]})
        assert status == 200 and score["object"] == "list"
        near, far = (d["score"] for d in score["data"])
        assert near > far
        assert score["usage"]["completion_tokens"] == 0
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            status, ranked = await post(worker, path, {"query": "red apples", "top_n": 2,
                                                      "documents": ["blue sky", "red apples", "green apples"]})
            assert status == 200, ranked
            assert [r["index"] for r in ranked["results"]] == [1, 2]
            assert ranked["results"][0]["document"] == {"text": "red apples"}
            assert ranked["usage"]["total_tokens"] > 0


async def test_each_model_kind_refuses_what_vllm_refuses(start_worker: StartWorker) -> None:
    chat, embed, cross = await start_worker(), await start_worker(EMBED), await start_worker(CROSS_ENCODER)
    refusals = [
        (chat, "/v1/embeddings", {"input": "x"}, "Embeddings"),
        (chat, "/v1/score", {"text_1": "a", "text_2": "b"}, "Score"),
        (chat, "/v1/audio/transcriptions", {}, "Transcriptions"),
        (embed, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "Chat Completions"),
        (embed, "/v1/responses", {"input": "x"}, "Responses"),
        (cross, "/v1/embeddings", {"input": "x"}, "Embeddings"),
        (cross, "/v1/completions", {"prompt": "x"}, "Completions"),
    ]
    for worker, path, body, api in refusals:
        status, answer = await post(worker, path, body)
        assert (status, answer["error"]["message"]) == (400, f"The model does not support {api} API"), path
    for worker in (chat, embed, cross):  # every kind has a tokenizer
        status, answer = await post(worker, "/tokenize", {"prompt": "hello world"})
        assert status == 200 and answer["count"] == 2


async def test_responses_api_plain_and_streamed(start_worker: StartWorker) -> None:
    worker = await start_worker()
    async with sdk(worker) as client:
        response = await client.responses.create(model="sim-model", input="Say hi", max_output_tokens=8)
        events = [event async for event in await client.responses.create(
            model="sim-model", instructions="be brief",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hi"}]}],
            max_output_tokens=6, stream=True)]
        follow_up = await client.responses.create(model="sim-model", input="And again",
                                                  previous_response_id=response.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="sim-model", input="x", previous_response_id="resp_unknown")
    assert response.object == "response" and response.status == "incomplete"  # cut at max_output_tokens
    assert response.usage is not None and response.usage.output_tokens == 8
    assert response.output_text.strip() and len(response.output_text.split()) == 8
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    completed = events[-1].response  # type: ignore[union-attr]
    assert len(deltas) == 6 and "".join(deltas) == completed.output_text
    assert completed.usage is not None and completed.usage.output_tokens == 6
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert follow_up.usage is not None and follow_up.usage.input_tokens > response.usage.input_tokens


async def test_tokenize_and_detokenize(start_worker: StartWorker) -> None:
    worker = await start_worker(max_model_len=4096)
    status, answer = await post(worker, "/tokenize", {"model": "sim-model", "prompt": "Hello, world",
                                                      "return_token_strs": True})
    assert status == 200
    assert answer["count"] == 3 and answer["max_model_len"] == 4096 and answer["token_strs"] == ["Hello", ",", "world"]
    status, chat = await post(worker, "/tokenize", {"messages": [{"role": "user", "content": "Hello"}]})
    assert status == 200 and chat["count"] > 3
    status, text = await post(worker, "/detokenize", {"tokens": answer["tokens"]})
    assert status == 200 and len(text["prompt"].split()) == 3
    status, wrong = await post(worker, "/tokenize", {"model": "other", "prompt": "x"})
    assert status == 404 and wrong["error"]["type"] == "NotFoundError"


async def test_transcription_and_translation_of_a_wav_file(start_worker: StartWorker) -> None:
    worker = await start_worker(ModelTasks(transcription=True), model="whisper-sim")
    audio = wav_bytes(4.0)
    async with sdk(worker) as client:
        transcript = await client.audio.transcriptions.create(model="whisper-sim",
                                                              file=("speech.wav", audio, "audio/wav"))
        with pytest.raises(openai.NotFoundError):
            await client.audio.transcriptions.create(model="other", file=("speech.wav", audio, "audio/wav"))
    assert len(transcript.text.split()) == 12  # 3 tokens per second of speech
    assert transcript.usage is not None and transcript.usage.seconds == 4  # type: ignore[union-attr]
    async with aiohttp.ClientSession() as session:  # the SDK's translations client is deprecated
        async with session.post(url(worker, "/v1/audio/translations"), data=audio_form(audio)) as response:
            translation = await response.json()
        async with session.post(url(worker, "/v1/audio/transcriptions"),
                                data=audio_form(audio, stream="true")) as response:
            body = await response.text()
    assert translation["text"] == transcript.text
    assert response.status == 200 and body.endswith("data: [DONE]\n\n") and '"transcription.chunk"' in body


def audio_form(audio: bytes, **fields: str) -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("model", "whisper-sim")
    for name, value in fields.items():
        form.add_field(name, value)
    form.add_field("file", audio, filename="speech.wav", content_type="audio/wav")
    return form
