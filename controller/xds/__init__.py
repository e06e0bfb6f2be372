"""xDS for Envoy: turns the fleet into clusters and endpoints and serves them over ADS, plus the bootstrap.

``build`` is pure (fleet → resources), ``cache`` holds versioned snapshots, ``server`` speaks the protocol,
``bootstrap`` renders Envoy's static config. Nothing here reads Redis or decides routing per request.
"""

from controller.xds.bootstrap import render_bootstrap
from controller.xds.server import XdsServer

__all__ = ["XdsServer", "render_bootstrap"]
