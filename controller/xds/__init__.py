"""What Envoy is told, in one home: its static bootstrap, the clusters and endpoints over ADS, the TLS/SDS files,
and the access log service its failed upstream attempts come back on.

- ``bootstrap``: the static bootstrap ``poolgate up`` starts Envoy with (listener, filters, routes, the
  extproc and xDS clusters); ``python -m controller.xds.bootstrap CONFIG`` renders the documented example.
- ``build`` → ``snapshots`` → ``server``: ``build`` is pure (fleet → resources, with ``endpoint_table``
  keeping each cluster's endpoints serialized); ``snapshots.FleetSnapshots`` checks that the snapshot holds
  together (every cluster a route can name is served, every EDS cluster has its load assignment and every
  assignment its cluster), refuses one that does not (an error logged, a count in ``metrics``, the last good
  one kept) and publishes the others to ``cache`` (versioned snapshots, version = content hash);
  ``server.AdsServer`` only speaks the protocol (a stream's state in ``server.AdsStream`` or
  ``delta.DeltaAdsStream``, on the common ``stream.StreamState``). ``XdsServer`` wires the two over one cache.
- ``envoy_tls``: Envoy's TLS contexts and the SDS files they read.
- ``upstream_failures``: the access log service on the xDS port, and the response flags that blame a worker.

Why here, in the controller, and not a package of its own: the controller is the one process that configures
Envoy once it runs, and the bootstrap and the ADS clusters must agree on names (the xDS and
extproc clusters, the fallback cluster its default route names, the pools' clusters) and on TLS files, so
one package keeps them from drifting. ``poolgate up`` (the application, a floor above) renders the bootstrap
from here; nothing here imports the application.

Nothing here reads Redis (``controller.xds_bridge`` hands the fleet in; the failure counts go to an injected
sink) or decides routing per request.
"""

from controller.xds.xds_server import XdsServer

__all__ = ["XdsServer"]
