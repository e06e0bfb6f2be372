"""``/v1/responses`` as vLLM serves it (generative models): a response object, or with ``stream`` the
Responses API's server-sent events, each ``event: <type>`` plus ``data: <json>`` and no ``[DONE]``.

A stream goes ``response.created`` → ``response.in_progress`` → ``response.output_item.added`` →
``response.content_part.added`` → one ``response.output_text.delta`` per token (the first is the time to
first token) → ``response.output_text.done`` → ``response.content_part.done`` → ``response.output_item.done``
→ ``response.completed``, whose ``response.usage`` holds ``input_tokens`` and ``output_tokens``.

``input`` is a string or a list of items (messages with string or part contents, function calls and their
outputs); ``instructions`` becomes the system message. Stored responses live in the worker's memory, as in
vLLM (``VLLM_ENABLE_RESPONSES_API_STORE``): a ``previous_response_id`` continues that conversation only on the
worker that produced it, which is why a router must send it back there.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import orjson
from aiohttp import web

from simworker import protocol, tokens
from simworker.driver import TokenStream
from simworker.endpoint_steps import admit, check_model
from simworker.engine import EngineRequest
from simworker.protocol import GenerationPlan, GenerationRequest, WorkerApiError
from simworker.request_fields import content_text, json_object, model_field
from simworker.server import WorkerApi, _json, _read_json

log = logging.getLogger(__name__)

STORED_RESPONSES = 1000
"""Conversations kept for ``previous_response_id``, oldest dropped first."""


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    generation: GenerationRequest
    messages: tuple[tuple[str, str], ...]
    """The conversation so far, the previous response's included, as (role, text)."""
    store: bool


def parse_responses(body: object, history: Mapping[str, tuple[tuple[str, str], ...]]) -> ResponsesRequest:
    fields = json_object(body)
    messages: list[tuple[str, str]] = []
    previous = fields.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str) or previous not in history:
            raise WorkerApiError(404, f"Response with id '{previous}' not found.", "previous_response_id")
        messages.extend(history[previous])
    instructions = fields.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.insert(0, ("system", instructions))
    messages.extend(_input_messages(fields.get("input")))
    max_tokens = fields.get("max_output_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise WorkerApiError(400, f"'max_output_tokens' must be a positive integer, got {max_tokens!r}",
                             "max_output_tokens")
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        raise WorkerApiError(400, f"'stream' must be a boolean, got {stream!r}", "stream")
    prompt = tuple(tokens.tokenize(tokens.render_chat(messages)))
    generation = GenerationRequest(kind="chat", model=model_field(fields), prompt_tokens=prompt,
                                   max_tokens=max_tokens, min_tokens=0, ignore_eos=False, stream=stream,
                                   include_usage=True)
    return ResponsesRequest(generation, tuple(messages), fields.get("store", True) is not False)


def _input_messages(value: object) -> list[tuple[str, str]]:
    if isinstance(value, str):
        return [("user", value)]
    if not isinstance(value, list) or not value:
        raise WorkerApiError(400, "'input' must be a string or a non-empty list of input items", "input")
    messages = []
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise WorkerApiError(400, f"input[{index}] must be an object", f"input[{index}]")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str):
                raise WorkerApiError(400, f"input[{index}].role must be a string", f"input[{index}].role")
            messages.append((role, content_text(item.get("content"))))
        elif kind == "function_call":
            messages.append(("assistant", f"{item.get('name', '')}({item.get('arguments', '')})"))
        elif kind == "function_call_output":
            messages.append(("tool", str(item.get("output", ""))))
        elif kind != "reasoning":
            raise WorkerApiError(400, f"input[{index}].type {kind!r} is not supported", f"input[{index}].type")
    return messages


def response_object(response_id: str, message_id: str, model: str, created: int, request: GenerationRequest,
                    text: str | None, finish_reason: str | None, input_tokens: int,
                    output_tokens: int) -> dict[str, object]:
    """The response as ``/v1/responses`` returns it and ``response.created`` / ``.completed`` carry it; ``text``
    None while it is in progress."""
    done = text is not None
    status = "in_progress" if not done else ("incomplete" if finish_reason == "length" else "completed")
    output = [message_item(message_id, text, "completed")] if done else []
    return {
        "id": response_id, "object": "response", "created_at": created, "model": model, "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": None, "metadata": None, "output": output, "parallel_tool_calls": True,
        "temperature": 1.0, "tool_choice": "auto", "tools": [], "top_p": 1.0, "background": False,
        "max_output_tokens": request.max_tokens, "previous_response_id": None, "reasoning": None,
        "service_tier": "auto", "text": None, "truncation": "disabled", "user": None,
        "usage": None if not done else {
            "input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens},
    }


def message_item(message_id: str, text: str | None, status: str) -> dict[str, object]:
    content = [] if text is None else [output_text_part(text)]
    return {"id": message_id, "type": "message", "role": "assistant", "status": status, "content": content}


def output_text_part(text: str) -> dict[str, object]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponsesEndpoint:
    def __init__(self, api: WorkerApi) -> None:
        self.api = api
        self._history: OrderedDict[str, tuple[tuple[str, str], ...]] = OrderedDict()

    async def create(self, request: web.Request) -> web.StreamResponse:
        api = self.api
        parsed = parse_responses(await _read_json(request), self._history)
        generation = parsed.generation
        model = check_model(api, generation.model)
        plan = protocol.plan_generation(generation, api.config.max_model_len)
        await admit(api)
        response_id, message_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        stream = api.driver.submit(EngineRequest(
            request_id=response_id, prompt_tokens=plan.prompt_tokens, output_target=plan.output_target,
            finish_reason_at_target=plan.finish_reason))
        created = int(time.time())
        try:
            if generation.stream:
                events = _EventWriter(await _prepare_sse(request))
                text = await self._stream(events, stream, plan, response_id, message_id, model, created, generation)
                answer: web.StreamResponse = events.response
            else:
                while stream.finished is None:
                    await stream.wait_change()
                if stream.finished.reason == "error":
                    raise WorkerApiError(500, "the engine failed while serving this request")
                text = protocol.generated_text(plan.text_seed, 0, stream.finished.output_tokens)
                answer = _json(response_object(response_id, message_id, model, created, generation, text,
                                               stream.finished.reason, plan.prompt_tokens,
                                               stream.finished.output_tokens))
        finally:
            api.driver.abort(response_id)
        if parsed.store and text is not None:
            self._remember(response_id, (*parsed.messages, ("assistant", text)))
        return answer

    async def _stream(self, events: _EventWriter, stream: TokenStream, plan: GenerationPlan, response_id: str,
                      message_id: str, model: str, created: int, generation: GenerationRequest) -> str | None:
        """Write the events as tokens arrive; the whole text, or None when the engine failed."""
        where = {"output_index": 0, "item_id": message_id, "content_index": 0}
        pending = response_object(response_id, message_id, model, created, generation, None, None, 0, 0)
        await events.send("response.created", {"response": pending})
        await events.send("response.in_progress", {"response": pending})
        await events.send("response.output_item.added",
                          {"output_index": 0, "item": message_item(message_id, None, "in_progress")})
        await events.send("response.content_part.added", {**where, "part": output_text_part("")})
        sent = 0
        try:
            while True:
                await stream.wait_change()
                finished = stream.finished
                if finished is not None and finished.reason == "error":
                    await events.send("error", {"code": "server_error", "param": None,
                                                "message": "the engine failed while serving this request"})
                    return None
                available = stream.tokens if finished is None else finished.output_tokens
                if available > sent:
                    await events.response.write(b"".join(events.frame("response.output_text.delta", {
                        **where, "delta": tokens.filler_token(plan.text_seed, index), "logprobs": []})
                        for index in range(sent, available)))
                sent = available
                if finished is not None:
                    break
            text = protocol.generated_text(plan.text_seed, 0, sent)
            await events.send("response.output_text.done", {**where, "text": text, "logprobs": []})
            await events.send("response.content_part.done", {**where, "part": output_text_part(text)})
            await events.send("response.output_item.done",
                              {"output_index": 0, "item": message_item(message_id, text, "completed")})
            await events.send("response.completed", {"response": response_object(
                response_id, message_id, model, created, generation, text, finished.reason, plan.prompt_tokens,
                sent)})
            await events.response.write_eof()
            return text
        except ConnectionResetError:
            log.debug("client of %s went away mid-stream", response_id)
            return None

    def _remember(self, response_id: str, messages: tuple[tuple[str, str], ...]) -> None:
        self._history[response_id] = messages
        while len(self._history) > STORED_RESPONSES:
            self._history.popitem(last=False)


class _EventWriter:
    """Numbers the events (``sequence_number``) and frames them as vLLM does."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response
        self._sequence = 0

    def frame(self, event_type: str, payload: dict[str, object]) -> bytes:
        body = {"type": event_type, "sequence_number": self._sequence, **payload}
        self._sequence += 1
        return b"event: " + event_type.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    async def send(self, event_type: str, payload: dict[str, object]) -> None:
        await self.response.write(self.frame(event_type, payload))


async def _prepare_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


def add_routes(app: web.Application, api: WorkerApi) -> None:
    app.router.add_post("/v1/responses", ResponsesEndpoint(api).create)
