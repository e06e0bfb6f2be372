"""``/v1/audio/transcriptions`` and ``/v1/audio/translations``: a multipart form whose ``model`` is a field
beside the audio ``file``, served by speech-to-text (Whisper-like) models.

The form becomes the request's data (``multipart.form_data``: text fields as strings, ``stream`` as a boolean,
the file as bytes). Cost from the clip's duration (``poolgate.kernel.audio_clip``): per 30 s chunk its encoder
positions are exact prompt tokens (they fill the cross-attention KV) and about 3 tokens per second of speech
are decode room. The context limit applies to the decoder alone (its 4 task tokens, then the text), so the
longest sequence is 4 exact tokens plus the ``prompt`` field's text. A stream (``stream=true``) is classified
like any other.
"""

from __future__ import annotations

from typing import Any

from extproc.endpoints.base import Endpoint, Measured
from extproc.endpoints.cost import EndpointCost
from extproc.errors import ApiError, invalid_request
from poolgate.kernel.audio_clip import TASK_TOKENS, audio_duration_s, chunk_costs
from poolgate.kernel.config import PoolTask

TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"
TRANSLATIONS_PATH = "/v1/audio/translations"


def measure_audio(data: dict[str, Any]) -> Measured | ApiError:
    audio = data.get("file")
    if not isinstance(audio, bytes) or not audio:
        return invalid_request("You must provide an audio 'file'.", "file", "missing_file")
    costs = chunk_costs(audio_duration_s(audio))
    prompt = data.get("prompt")
    parts = (prompt,) if isinstance(prompt, str) and prompt else ()
    chars = sum(map(len, parts))
    cost = EndpointCost(output_tokens=sum(o for _, o in costs), longest_chars=chars, longest_token_ids=TASK_TOKENS)
    return Measured(chars, sum(p for p, _ in costs), 0, parts, cost)


_SPEECH: frozenset[PoolTask] = frozenset({"transcription"})
TRANSCRIPTIONS = Endpoint(TRANSCRIPTIONS_PATH, "", measure_audio, pool_tasks=_SPEECH, form=True)
TRANSLATIONS = Endpoint(TRANSLATIONS_PATH, "", measure_audio, pool_tasks=_SPEECH, form=True)
