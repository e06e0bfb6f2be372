"""extproc: Envoy's external processor. Per request it picks the pool and the exact worker, and tells Envoy.

What it is for: turning one HTTP request that Envoy holds into a routing decision (or an OpenAI-style error)
from an in-memory fleet snapshot, and watching the response where a feature needs it (usage, the public
model name, GenAI metrics).

What it must not do: block or call Redis on the picking path (decisions are pure functions over the
snapshot; Redis is read by the watcher and the quota calls, off the pick); raise into gRPC (every failure is
an answer); trust a client's routing or tenant headers; import the controller.

Entry points: ``cli`` (``poolgate extproc``) → ``server.serve`` (the one reader of the whole configuration;
it builds the parts) → ``assembly.build_service``. Rooms, in the order one request meets them:

- ``service``: the gRPC servicer, the only translator of Envoy's messages (with ``answers``, the only
  builder of Envoy's answers; ``errors`` holds the request-path error values);
- ``pipeline``: the director and its stages (identify, resolve, admit, hold, place, respond), which answer
  outcomes, never protobuf;
- what the stages use: ``request`` and ``endpoints`` (parsing), ``tenancy``, ``catalogue`` and
  ``catalogue_source``, ``parameters``, ``quota``, ``flow_queue``, ``scheduling`` (the pure pick and its
  plugin registry), ``inflight``, ``reservations``, ``affinity``, ``endpoint_picker``, ``usage``, ``rename``,
  ``genai``, ``metrics``;
- ``replica``: what the replica keeps across requests (reservations, affinity, queue, queue order), built
  by the wiring and handed to the stages and to ``peers``, the exchange with the other replicas;
- ``snapshot`` and ``watcher``: the frozen fleet view and the Redis adapter that refreshes it.

Importing this package imports nothing else, so ``from extproc.request import …`` stays light.
"""
