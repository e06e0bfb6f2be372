"""The one base class of poolgate's own exceptions.

Every error poolgate raises on purpose derives from ``PoolgateError``, so a caller can catch poolgate's
errors apart from library and programming errors; library exceptions are converted at the boundary with
``raise … from``.
"""

from __future__ import annotations


class PoolgateError(Exception):
    """Base of every exception poolgate raises itself."""
