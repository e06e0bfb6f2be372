"""What kind of model a simulated worker serves, and which OpenAI endpoints that kind answers.

vLLM decides a model's tasks from two flags (``--task`` is gone since 0.10): ``--runner generate|pooling``
(``auto`` picks ``pooling`` when a conversion is asked for, else ``generate``) and, for pooling runners,
``--convert embed|classify`` (``auto``: embed, what the simulated model's "architecture" converts to).
Speech-to-text (Whisper-like architectures) vLLM recognises by itself; the simulator needs
``--transcription`` to play such a model.

- ``generate``: chat, completions, Responses API; with ``--transcription`` also the audio endpoints;
- ``embed``: embeddings, and score / rerank through the embeddings' cosine similarity (as vLLM does);
- ``classify`` (a cross-encoder): score and rerank, no embeddings;
- every kind: tokenize and detokenize.

An endpoint the model does not serve answers vLLM's refusal: 400 ``The model does not support … API``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

Runner = Literal["generate", "pooling"]
Convert = Literal["none", "embed", "classify"]
Api = Literal["chat", "completions", "responses", "embeddings", "score", "rerank", "transcriptions",
              "translations"]

API_NAMES: dict[Api, str] = {
    "chat": "Chat Completions", "completions": "Completions", "responses": "Responses",
    "embeddings": "Embeddings", "score": "Score", "rerank": "Rerank (Score)", "transcriptions": "Transcriptions",
    "translations": "Translations",
}
"""How vLLM names each API in its refusal."""

PATH_APIS: dict[str, Api] = {
    "/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
    "/v1/embeddings": "embeddings", "/score": "score", "/v1/score": "score", "/rerank": "rerank",
    "/v1/rerank": "rerank", "/v2/rerank": "rerank", "/v1/audio/transcriptions": "transcriptions",
    "/v1/audio/translations": "translations",
}
DEFAULT_EMBEDDING_DIM = 1024


@dataclass(frozen=True, slots=True)
class ModelTasks:
    runner: Runner = "generate"
    convert: Convert = "none"
    transcription: bool = False
    embedding_dim: int = DEFAULT_EMBEDDING_DIM
    """Width of the pooled output (the model's hidden size; bge-m3 has 1024)."""

    def __post_init__(self) -> None:
        if self.runner == "generate" and self.convert != "none":
            raise ValueError(f"--convert {self.convert} needs --runner pooling (or auto)")
        if self.runner == "pooling" and self.convert == "none":
            raise ValueError("--runner pooling needs a pooling conversion (--convert embed or classify)")
        if self.transcription and self.runner != "generate":
            raise ValueError("--transcription is a generative (speech-to-text) model; drop --runner pooling")
        if self.embedding_dim < 1:
            raise ValueError("--embedding-dim must be at least 1")

    @property
    def generates(self) -> bool:
        return self.runner == "generate"

    def serves(self, api: Api) -> bool:
        if api in ("chat", "completions", "responses"):
            return self.generates
        if api == "embeddings":
            return self.convert == "embed"
        if api in ("score", "rerank"):
            return self.convert in ("embed", "classify")
        return self.transcription

    def refusal(self, path: str) -> str | None:
        """vLLM's message for a path this model does not serve, or None when it serves it (or it is not an
        endpoint tied to a model kind)."""
        api = PATH_APIS.get(path)
        if api is None or self.serves(api):
            return None
        return f"The model does not support {API_NAMES[api]} API"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model kind (vLLM's flags)")
    group.add_argument("--runner", choices=("auto", "generate", "pooling"), default="auto",
                       help="generate text, or pool hidden states (embedding / scoring models); auto: pooling "
                            "when --convert asks for it")
    group.add_argument("--convert", choices=("auto", "none", "embed", "classify"), default="auto",
                       help="what a pooling runner turns the model into: embed (embeddings, score, rerank) or "
                            "classify (a cross-encoder: score, rerank); auto: embed for --runner pooling")
    group.add_argument("--transcription", action="store_true",
                       help="simulate a speech-to-text model (vLLM tells Whisper-like models by their "
                            "architecture): serve /v1/audio/transcriptions and /v1/audio/translations")
    group.add_argument("--embedding-dim", type=int, default=DEFAULT_EMBEDDING_DIM,
                       help="width of embedding vectors (the simulated model's hidden size, default %(default)s)")


def from_args(args: argparse.Namespace) -> ModelTasks:
    """Resolve ``auto`` as vLLM does; ValueError names the bad combination."""
    convert: str = args.convert
    runner: str = args.runner
    if runner == "auto":
        runner = "pooling" if convert in ("embed", "classify") else "generate"
    if convert == "auto":
        convert = "embed" if runner == "pooling" else "none"
    return ModelTasks(runner=runner, convert=convert, transcription=args.transcription,  # type: ignore[arg-type]
                      embedding_dim=args.embedding_dim)
