"""Precise KV-cache knowledge from the engines' own KV events (vLLM's ``--kv-events-config``).

``wire`` decodes vLLM's messages, ``keys`` computes the router's own block keys from token ids, ``index``
holds which worker caches which block, ``subscriber`` keeps one ZMQ subscription per Ready worker (with
replay after gaps), ``tokenizer`` makes a prompt's token ids as the engine makes them, and ``lookup`` turns
a request into cached-prefix lengths per worker for the scheduler. Pure parts do no I/O; only the
subscriber touches sockets. Nothing here imports the simulated worker.
"""
