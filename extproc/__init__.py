"""extproc: Envoy's external processor. Per request: parse, admit, pick a pool and worker, answer Envoy.

It never does I/O inside the pick: decisions are pure functions over an in-memory fleet snapshot.

Modules: ``request`` (parse) · ``errors`` (the one error type) · ``scheduling`` (estimates and the pure pick:
filters and scorers) · ``snapshot`` (frozen fleet view) · ``inflight`` (optimistic in-flight counts) ·
``reservations`` (optimistic KV and prefill placed but not yet reported) · ``affinity`` (session/prefix →
worker map) · ``watcher`` (the Redis adapter) · ``answers`` (ext_proc messages) · ``service`` (gRPC servicer,
per-stream state, holding requests that find no capacity) · ``server`` (``serve()``: the wiring) · ``cli``
(``poolgate extproc``).
"""
