"""What Envoy is told, in one home: its static bootstrap, the clusters and endpoints over ADS, the TLS/SDS files,
and the access log service its failed upstream attempts come back on.

- ``bootstrap``: the static bootstrap ``poolgate up`` starts Envoy with (listener, filters, routes, the
  extproc and xDS clusters); ``python -m controller.xds.bootstrap CONFIG`` renders the documented example.
- ``build`` → ``snapshots`` → ``server``: ``build`` is pure (fleet → resources, with ``endpoint_table``
  keeping each cluster's endpoints serialized); ``snapshots.FleetSnapshots`` checks that clusters and load
  assignments agree and publishes them to ``cache`` (versioned snapshots, version = content hash);
  ``server.AdsServer`` only speaks the protocol (a stream's state in ``server.AdsStream`` or
  ``delta.DeltaAdsStream``, on the common ``stream.StreamState``). ``XdsServer`` wires the two over one cache.
- ``envoy_tls``: Envoy's TLS contexts and the SDS files they read.
- ``upstream_failures``: the access log service on the xDS port, and the response flags that blame a worker.

Nothing here reads Redis (``controller.xds_bridge`` hands the fleet in; the failure counts go to an injected
sink) or decides routing per request.
"""

from controller.xds.xds_server import XdsServer

__all__ = ["XdsServer"]
