"""agent: per-node reader of workers' vLLM ``/metrics`` and GPUs, writing live facts into the fleet in Redis.

``agent`` holds the loop (``Agent``, ``run_agent``); ``vllm_metrics`` parses a scrape, ``rates`` derives
TTFT and prefill throughput from successive scrapes, ``live`` turns them into a record's live fields and
decides when a change is worth an announcement; ``gpus`` reads NVML and ``podresources`` the kubelet's
PodResources API (which GPUs each worker pod holds); ``cli`` is ``poolgate agent``.

It writes only live facts (KV usage and capacity, queue, throughput, GPU memory) through the
``FleetStore``; it never registers, deregisters or changes a worker's state: health is the controller's
job. It must not import ``extproc`` or ``controller``. Parsing and rate derivations are pure; HTTP, NVML,
the kubelet and Redis stay in thin adapters that tests replace. Import the modules themselves
(``agent.agent``, ``agent.gpus`` …): this file imports nothing, so the NVML reader loads without the rest.
"""
