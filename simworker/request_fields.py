"""Field checks the newer endpoints' request parsers share (chat and completions keep theirs in ``protocol``)."""

from __future__ import annotations

from collections.abc import Mapping

from simworker.protocol import WorkerApiError


def json_object(body: object) -> Mapping[str, object]:
    if not isinstance(body, dict):
        raise WorkerApiError(400, "the request body must be a JSON object")
    return body


def model_field(fields: Mapping[str, object]) -> str | None:
    """``model`` is optional on vLLM's endpoints (a single-model server knows its model)."""
    model = fields.get("model")
    if model is not None and not isinstance(model, str):
        raise WorkerApiError(400, f"'model' must be a string, got {model!r}", "model")
    return model


def content_text(content: object) -> str:
    """A message's text: a string, or the text of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""
