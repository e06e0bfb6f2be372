"""Keep secrets out of logs, terminals and metrics: URLs lose their password, known secrets their text.

Redis URLs carry passwords (``redis://:pw@host``, ``rediss://user:pw@host``) and end up in start-up lines and
error messages; every place that prints or logs a URL passes it through ``redact_url`` first.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
SECRET_QUERY_KEYS = frozenset({"password", "token", "api_key", "apikey", "secret", "access_token"})
"""Query parameters some clients accept in place of the userinfo password."""


def redact_url(url: str) -> str:
    """``url`` with any password (userinfo or query parameter) replaced by ``***``; the user name, host,
    port, path and other parameters stay, so the line still says where it points. Text that does not
    parse as a URL comes back masked whole rather than risk printing a secret."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # ValueError on a malformed authority such as "host:pa:ss"
    except ValueError:
        return MASK
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostinfo = netloc.rpartition("@")
        user, has_password, _ = userinfo.partition(":")
        # A lone userinfo is the password for some clients (``redis://secret@host``): mask it too.
        netloc = f"{user}:{MASK}@{hostinfo}" if has_password else f"{MASK}@{hostinfo}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(key.lower() in SECRET_QUERY_KEYS for key, _ in pairs):
            query = urlencode([(k, MASK if k.lower() in SECRET_QUERY_KEYS else v) for k, v in pairs], safe="*")
    if netloc == parts.netloc and query == parts.query:
        return url
    redacted = urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    if not netloc and url.startswith(f"{parts.scheme}://"):  # unix:///path keeps its empty authority
        redacted = f"{parts.scheme}://" + redacted.removeprefix(f"{parts.scheme}:")
    return redacted


def redact_text(text: str, secrets: Iterable[str | None]) -> str:
    """``text`` with every occurrence of each known secret (tokens, keys, passwords) replaced by ``***``."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text
