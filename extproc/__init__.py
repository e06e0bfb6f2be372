"""extproc: Envoy's external processor. Per request: parse, admit, pick a pool and worker, answer Envoy.

It never does I/O inside the pick: decisions are pure functions over an in-memory fleet snapshot.

Modules: ``request`` (parse) · ``endpoints`` (each model-addressed endpoint's parser and cost, the table of routed
paths) · ``errors`` (the one error type) · ``tenancy`` (API key or trusted header →
tenant) · ``quota`` (per-tenant concurrency / RPM / TPM in Redis, one script call each way) · ``flow_queue``
(the priority queue's pure discipline) · ``usage`` (token usage read from response bodies) · ``genai`` (one
request's OpenTelemetry GenAI timings and attributes) · ``scheduling`` (estimates and the pure pick: filters and
scorers) · ``snapshot`` (frozen fleet view) · ``inflight``
(optimistic in-flight counts) · ``reservations`` (optimistic KV and prefill placed but not yet reported) ·
``affinity`` (session/prefix → worker map) · ``watcher`` (the fleet's Redis adapter) · ``answers`` (ext_proc
messages) · ``service`` (gRPC servicer, per-stream state, admission, the queue's release passes) · ``server``
(``serve()``: the wiring) · ``cli`` (``poolgate extproc``).
"""
