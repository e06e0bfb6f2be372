"""The OpenAI inference endpoints extproc routes, one request-parsing module each, declared in ``ENDPOINTS``.

Any other path passes through untouched. A new endpoint is a module here (its path, its prompt's
measurement, its ``Endpoint`` declaration) and its entry below; the pipeline's stages read the declaration
(the estimate: ``chat_template``; the GenAI metrics: ``operation``).
"""

from collections.abc import Mapping
from types import MappingProxyType

from extproc.endpoints import chat, completions
from extproc.endpoints.base import Endpoint, Measured
from extproc.endpoints.chat import CHAT_PATH
from extproc.endpoints.completions import COMPLETIONS_PATH

ENDPOINTS: Mapping[str, Endpoint] = MappingProxyType({e.path: e for e in (chat.ENDPOINT, completions.ENDPOINT)})

__all__ = ["CHAT_PATH", "COMPLETIONS_PATH", "ENDPOINTS", "Endpoint", "Measured"]
