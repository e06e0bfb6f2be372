"""simworker: a simulated vLLM worker, so routing policies can be compared without GPUs.

It speaks vLLM's OpenAI server surface (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``
with SSE, ``/health``, ``/metrics`` with vLLM's names, ``/version``) in front of a pure model of one
engine: continuous batching over a paged KV cache, chunked prefill, preemption, prefix caching.
Fault knobs (errors, latency, hang, crash, KV leak, slow start) make failure paths testable.

It must not import the router or the controller: it is a stand-in for an external process.
"""
