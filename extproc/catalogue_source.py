"""Holds extproc's current model catalogue and swaps it whole when the configuration file changes.

A request reads ``current`` once, when its body arrives, and keeps the route it resolved: a reload never
changes a request in flight, and a half-built catalogue is never visible (the attribute is replaced in one
assignment after the new catalogue is complete).
"""

from __future__ import annotations

import logging

from extproc.catalogue import Catalogue
from poolgate.kernel.config import CatalogueSettings

log = logging.getLogger(__name__)


class CatalogueSource:
    def __init__(self, catalogue: Catalogue) -> None:
        self.current = catalogue

    def apply(self, settings: CatalogueSettings) -> None:
        """Use the catalogue section of a new (already validated) configuration; an unchanged one is kept."""
        if settings == self.current.settings:
            return
        self.current = Catalogue(settings, self.current.generation + 1)
        log.info("model catalogue reloaded (generation %d, %d models)", self.current.generation,
                 len(settings.models))
