"""controller: keeps the worker fleet, never in a request's path.

``main`` (``poolgate controller``) wires the parts over one ``FleetStore``, each with its config section:

- the registry API (``registry_api``: register, heartbeat, deregister, drain, scale; shared token);
- the Redis → Envoy path: ``xds_bridge`` reads the registry, ``xds`` builds, checks, caches and serves it
  (ADS); ``xds`` is the one home of what Envoy is told (its bootstrap, TLS/SDS, the failure access log);
- health: ``monitor`` probes every worker (``probe``) and judges it (``health``, pure);
- instances: ``instances`` turns remedies, operator commands and scale targets into calls on a backend
  (``backend``: ``local_backend`` processes with GPU ``placement``, or ``kube_backend`` Deployments),
  every departure through ``drain``; ``adapters`` keeps LoRA adapters loaded;
- scaling: ``autoscaler`` samples and acts on ``autoscale``'s pure decision, on the ``lease`` holder only.

It must not import ``extproc`` nor decide anything per request: Envoy and extproc keep serving on their
last state while it is away. It runs the node ``agent`` in-process for its own workers. Import the
modules themselves; this file imports nothing.
"""
