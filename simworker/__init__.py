"""simworker: a simulated vLLM worker, so routing policies can be compared without GPUs.

It speaks vLLM's OpenAI server surface (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``
with SSE, ``/health``, ``/metrics`` with vLLM's names, ``/version``) in front of a pure model of one
engine: continuous batching over a paged KV cache, chunked prefill, preemption, prefix caching.
Fault knobs (errors, latency, hang, crash, KV leak, slow start) make failure paths testable.

The pure model is ``engine`` over ``kv_cache`` (sized and timed by ``presets``, with ``lora`` adapters and
``tokens``); ``driver`` runs it in real time; ``protocol`` (the OpenAI wire format), ``server`` (HTTP),
``metrics`` (vLLM's Prometheus names) and ``faults`` face the outside; ``worker`` builds one worker and
``cli`` is ``poolgate simworker``.

It must not import the router (``extproc``), the ``controller``, the ``agent`` or the fleet's Redis schema:
it is a stand-in for an external process and knows poolgate only through HTTP (of the kernel it uses
``shutdown``, ``errors`` and the worker header's name in ``routing``).
"""
