"""What every config section shares: frozen, unknown fields refused; and the one error loading raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from poolgate.kernel.errors import PoolgateError


class ConfigError(PoolgateError):
    """The configuration cannot be used; the message lists every problem with its field path."""


class Section(BaseModel):
    """A config section: frozen once loaded, and a field it does not know is an error, not ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid")
