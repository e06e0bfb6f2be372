"""``/v1/audio/transcriptions`` and ``/v1/audio/translations``: a multipart form whose ``model`` is a field
beside the audio ``file``, served by speech-to-text (Whisper-like) models.

Cost from the clip's duration (``poolgate.kernel.audio_clip``): per 30 s chunk, its encoder positions are
prompt (they fill the cross-attention KV) and about 3 tokens per second of speech are decode room. The context
limit applies to the decoder alone (its 4 task tokens, then the text), so ``longest_token_ids`` is 4. With
``stream=true`` (a form field) the answer is a stream like chat's, so the task class follows the usual rules.
"""

from __future__ import annotations

from extproc.endpoints.cost import EndpointCost
from extproc.endpoints.fields import facts, model_of
from extproc.endpoints.multipart import FormPart
from extproc.errors import ApiError, invalid_request
from extproc.request import RequestFacts, RequestHead
from poolgate.kernel.audio_clip import TASK_TOKENS, audio_duration_s, chunk_costs


def parse_audio(head: RequestHead, parts: tuple[FormPart, ...]) -> RequestFacts | ApiError:
    fields = {part.name: part for part in parts}
    model = model_of(fields["model"].text().strip() if "model" in fields else None)
    if isinstance(model, ApiError):
        return model
    audio = fields.get("file")
    if audio is None or not audio.data:
        return invalid_request("You must provide an audio 'file'.", "file", "missing_file")
    costs = chunk_costs(audio_duration_s(audio.data))
    stream = _text(fields, "stream").lower() == "true"
    prompt = _text(fields, "prompt")
    cost = EndpointCost(template_tokens=sum(p for p, _ in costs), output_tokens=sum(o for _, o in costs),
                        longest_chars=len(prompt), longest_token_ids=TASK_TOKENS)
    include_usage = _text(fields, "stream_include_usage").lower() == "true"
    return facts(head, model, (prompt,) if prompt else (), cost, stream=stream, include_usage=include_usage)


def _text(fields: dict[str, FormPart], name: str) -> str:
    part = fields.get(name)
    return part.text().strip() if part is not None else ""
