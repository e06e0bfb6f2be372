"""The paths poolgate routes by model (all POST), apart from their parsers so ``request`` can name them without
importing the parsers (which import ``request``)."""

from __future__ import annotations

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RESPONSES_PATH = "/v1/responses"
EMBEDDINGS_PATH = "/v1/embeddings"
SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"
TRANSLATIONS_PATH = "/v1/audio/translations"

ROUTED_PATHS = frozenset({CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH, EMBEDDINGS_PATH, *SCORE_PATHS,
                          *RERANK_PATHS, TOKENIZE_PATH, DETOKENIZE_PATH, TRANSCRIPTIONS_PATH, TRANSLATIONS_PATH})
OUTSIDE_V1 = tuple(sorted(path for path in ROUTED_PATHS if not path.startswith("/v1/")))
"""Routed paths Envoy must send through extproc besides the ``/v1/`` prefix (vLLM serves them there)."""
