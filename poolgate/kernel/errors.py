"""The root of poolgate's own exceptions, and the branches a caller catches by kind.

Every error poolgate raises on purpose derives from ``PoolgateError``, so a caller can catch poolgate's
errors apart from library and programming errors; library exceptions are converted at the boundary with
``raise … from``. Where a caller reacts to a kind of failure rather than to one module's error, the class
derives from that kind's branch:

- ``ConfigError`` (``poolgate.kernel.config``): the configuration cannot be used; start-up stops.
- ``UpstreamError``: a process poolgate reads from (a worker's ``/metrics`` or KV events, the kubelet, a GPU
  source, an HTTP peer) did not answer, or answered what cannot be used. The caller degrades: it counts,
  logs once, and tries again on its next round.
- ``Refused``: what was asked is declined, for the reason the message gives (a malformed request, a
  placement no GPU fits, a controller that is not the leader). The asker changes the request or asks
  elsewhere; nothing is broken.

An exception that fits none of them derives from ``PoolgateError`` directly. A class keeps a built-in base
that callers catch it by (``MetricsFormatError`` is a ``ValueError`` too).
"""

from __future__ import annotations


class PoolgateError(Exception):
    """Base of every exception poolgate raises itself."""


class UpstreamError(PoolgateError):
    """A process poolgate reads from did not answer, or answered what cannot be used."""


class Refused(PoolgateError):
    """What was asked is declined; the message says why (and, where it can, what to ask instead)."""
