"""xDS for Envoy: build → cache → serve. Turns the fleet into clusters and endpoints and serves them over ADS.

``build`` is pure (fleet → resources), ``cache`` holds versioned snapshots (version = content hash),
``server`` only speaks the protocol (a stream's state in ``server.AdsStream`` or ``delta.DeltaAdsStream``,
on the common ``stream.StreamState``). Nothing here reads Redis (``controller.xds_bridge`` hands the fleet
in) or decides routing per request; Envoy's static bootstrap is the application's
(``poolgate.envoy_bootstrap``).
"""

from controller.xds.server import XdsServer

__all__ = ["XdsServer"]
