"""agent: per-node reader of workers' vLLM ``/metrics`` and GPUs, writing live facts into the fleet in Redis.

It writes only live facts (KV usage and capacity, queue, throughput, GPU memory) with heartbeats; it never
registers, deregisters or changes a worker's state: health is the controller's job. Parsing and rate
derivations are pure; HTTP, NVML, the kubelet's PodResources API and Redis stay in thin adapters that tests
replace. Import the modules themselves (``agent.agent``, ``agent.gpus`` …): this file
imports nothing, so the NVML reader loads without the rest.
"""
