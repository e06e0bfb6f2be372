"""Holds extproc's current model catalogue and swaps it whole when the configuration file changes.

A request reads ``current`` once, when its body arrives, and keeps the route it resolved: a reload never
changes a request in flight, and a half-built catalogue is never visible (the attribute is replaced in one
assignment after the new catalogue is complete).
"""

from __future__ import annotations

import logging

from extproc.catalogue import Catalogue
from poolgate.kernel.config import Config

log = logging.getLogger(__name__)


class CatalogueSource:
    def __init__(self, catalogue: Catalogue) -> None:
        self.current = catalogue

    def apply(self, config: Config) -> None:
        """Use the catalogue of a new (already validated) configuration; unchanged catalogues are kept."""
        if config.catalogue == self.current.settings:
            return
        self.current = Catalogue(config.catalogue, self.current.generation + 1)
        log.info("model catalogue reloaded (generation %d, %d models)", self.current.generation,
                 len(config.catalogue.models))
