"""poolgate.kernel: what every poolgate program shares, and nothing that is one program's own.

- ``config``: the one YAML configuration, typed and validated at load (``load_config``, ``Config`` and its
  sections; ``ConfigError`` names every bad field's path).
- ``fleet``: the fleet schema, ``WorkerRecord`` and ``WorkerState``, and which fields are live facts.
- ``keys`` and ``store``: the fleet in Redis. ``FleetStore`` is the only code that reads or writes a fleet
  key; ``RedisKeys`` the only place a key name is spelled.
- ``outage``: living through a Redis outage (``OutageLog``, ``ReturnGrace``, ``REDIS_ERRORS``).
- ``errors`` (``PoolgateError``, the base of poolgate's own exceptions, with the kinds ``UpstreamError`` and
  ``Refused``), ``routing`` (names Envoy and extproc agree on), ``kv_event_shapes`` (vLLM's KV-event tags and
  field orders, for the simulator's encoder and extproc's decoder), ``logging_setup``, ``shutdown`` (graceful
  stop with a hard deadline), ``reload`` (config file changes), ``redaction`` (no secrets in logs).

It must not import ``extproc``, ``controller``, ``agent``, ``simworker`` or the application layer
(``poolgate.cli``, ``poolgate.up`` and the other top modules of ``poolgate``). Import the module you need:
this file imports nothing, so the simulated worker can use ``shutdown`` and ``routing`` without loading
Redis or pydantic.
"""
