"""vLLM's JSON-valued flags (``--kv-transfer-config``, ``--kv-events-config``): the text must be one JSON object.

What its fields mean is each flag's own module's (``kv_transfer``, ``kv_publisher``); the errors name the flag.
"""

from __future__ import annotations

from typing import Any

import orjson


def json_object(flag: str, text: str) -> dict[str, Any]:
    """The flag's object; ValueError names the flag when the text is not JSON or not an object."""
    try:
        raw = orjson.loads(text)
    except orjson.JSONDecodeError as error:
        raise ValueError(f"{flag} is not JSON: {error}") from error
    if not isinstance(raw, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return raw
