"""Parsing vLLM /metrics pages: V1 and V0 layouts, data parallel, missing families, odd formatting."""

from __future__ import annotations

import pytest

from agent.vllm_metrics import EngineMetrics, MetricsFormatError, parse_engine_metrics

# A V1-style page in the shape recent vLLM serves: sorted labels, engine="0", counters with _created
# siblings, a histogram, HELP lines with trailing spaces, and unrelated process/http families.
V1_PAGE = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 812.0
# HELP http_requests_total Total number of requests by method, status and handler.\x20
# TYPE http_requests_total counter
http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"} 12.0
# HELP http_requests_created Total number of requests by method, status and handler.\x20
# TYPE http_requests_created gauge
http_requests_created{handler="/v1/chat/completions",method="POST",status="2xx"} 1.7101e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-chat"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-chat"} 2.0
# HELP vllm:num_requests_waiting_by_reason Waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-chat",reason="capacity"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-chat"} 0.4375
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="fp8",enable_prefix_caching="True",engine="0",\
gpu_memory_utilization="0.85",kv_cache_size_tokens="64000",model_name="tiny-chat",num_gpu_blocks="2000",\
num_gpu_blocks_override="None"} 1.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny-chat"} 4.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="tiny-chat"} 1.7101000012e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny-chat"} 9100.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="tiny-chat"} 1.7101000013e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny-chat"} 777.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="tiny-chat"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="tiny-chat"} 9.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny-chat"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny-chat"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny-chat"} 2.5
# HELP vllm:time_to_first_token_seconds_created Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds_created gauge
vllm:time_to_first_token_seconds_created{engine="0",model_name="tiny-chat"} 1.7101000014e+09
"""

# A V0-style page: model_name only, the old KV gauge name, cache config without model_name, and no final
# newline (as some servers send it).
V0_PAGE = (
    '# HELP vllm:cache_config_info information of cache_config\n'
    '# TYPE vllm:cache_config_info gauge\n'
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",gpu_memory_utilization="0.8",'
    'num_cpu_blocks="0",num_gpu_blocks="500",sliding_window="None"} 1.0\n'
    '# HELP vllm:num_requests_running Number of requests currently running on GPU.\n'
    '# TYPE vllm:num_requests_running gauge\n'
    'vllm:num_requests_running{model_name="org/small-model"} 1.0\n'
    '# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n'
    '# TYPE vllm:num_requests_waiting gauge\n'
    'vllm:num_requests_waiting{model_name="org/small-model"} 0.0\n'
    '# HELP vllm:num_requests_swapped Number of requests swapped to CPU.\n'
    '# TYPE vllm:num_requests_swapped gauge\n'
    'vllm:num_requests_swapped{model_name="org/small-model"} 0.0\n'
    '# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.\n'
    '# TYPE vllm:gpu_cache_usage_perc gauge\n'
    'vllm:gpu_cache_usage_perc{model_name="org/small-model"} 0.125\n'
    '# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n'
    '# TYPE vllm:prompt_tokens_total counter\n'
    'vllm:prompt_tokens_total{model_name="org/small-model"} 42.0\n'
    '# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.\n'
    '# TYPE vllm:time_to_first_token_seconds histogram\n'
    'vllm:time_to_first_token_seconds_bucket{le="0.5",model_name="org/small-model"} 1.0\n'
    'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="org/small-model"} 1.0\n'
    'vllm:time_to_first_token_seconds_count{model_name="org/small-model"} 1.0\n'
    'vllm:time_to_first_token_seconds_sum{model_name="org/small-model"} 0.2'
)

# Two engines behind one server (data parallel): counts add up, KV usage is their mean.
DATA_PARALLEL_PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="dp"} 4.0
vllm:num_requests_running{engine="1",model_name="dp"} 6.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="dp"} 1.0
vllm:num_requests_waiting{engine="1",model_name="dp"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="dp"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="dp"} 0.6
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",model_name="dp",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",model_name="dp",num_gpu_blocks="1500"} 1.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="dp"} 100.0
vllm:generation_tokens_total{engine="1",model_name="dp"} 50.0
"""

# What the simulated worker adds: a stand-in for NVML, without labels.
SIM_GPU_LINES = """\
# TYPE poolgate_sim_gpu_memory_total_bytes gauge
poolgate_sim_gpu_memory_total_bytes 2.5769803776e+10
# TYPE poolgate_sim_gpu_memory_used_bytes gauge
poolgate_sim_gpu_memory_used_bytes 2.147483648e+10
# TYPE poolgate_sim_gpu_utilization gauge
poolgate_sim_gpu_utilization 0.375
"""


def test_v1_page() -> None:
    assert "handler. \n" in V1_PAGE  # HELP text with a trailing space
    metrics = parse_engine_metrics(V1_PAGE)
    assert metrics == EngineMetrics(
        running=3, waiting=2, kv_usage=0.4375, kv_block_size=32, num_gpu_blocks=2000, preemptions_total=4.0,
        prompt_tokens_total=9100.0, generation_tokens_total=777.0, ttft_sum_s=2.5, ttft_count=10.0,
        waiting_by_reason=(("capacity", 2),))
    assert metrics.kv_capacity_tokens == 64000


def test_v0_page_without_final_newline() -> None:
    assert not V0_PAGE.endswith("\n")
    metrics = parse_engine_metrics(V0_PAGE)
    assert (metrics.running, metrics.waiting, metrics.kv_usage) == (1, 0, 0.125)
    assert (metrics.kv_block_size, metrics.kv_capacity_tokens) == (16, 8000)
    assert (metrics.prompt_tokens_total, metrics.ttft_sum_s, metrics.ttft_count) == (42.0, 0.2, 1.0)
    assert metrics.preemptions_total is None and metrics.generation_tokens_total is None


def test_v0_inter_token_histogram_under_its_old_name() -> None:
    page = V0_PAGE + (
        '\n# TYPE vllm:time_per_output_token_seconds histogram\n'
        'vllm:time_per_output_token_seconds_count{model_name="org/small-model"} 6.0\n'
        'vllm:time_per_output_token_seconds_sum{model_name="org/small-model"} 0.19\n')
    metrics = parse_engine_metrics(page)
    assert (metrics.inter_token_sum_s, metrics.inter_token_count) == (0.19, 6.0)
    assert parse_engine_metrics(V0_PAGE).inter_token_count is None  # not exported: unknown, not zero


def test_data_parallel_engines_are_combined() -> None:
    metrics = parse_engine_metrics(DATA_PARALLEL_PAGE)
    assert (metrics.running, metrics.waiting, metrics.generation_tokens_total) == (10, 1, 150.0)
    assert metrics.kv_usage == pytest.approx(0.4)
    assert metrics.kv_capacity_tokens == 2500 * 16


def test_simulated_gpu_gauges() -> None:
    metrics = parse_engine_metrics(V1_PAGE + SIM_GPU_LINES)
    assert metrics.sim_gpu_memory_total_bytes == 24 * 1024**3
    assert metrics.sim_gpu_memory_used_bytes == 20 * 1024**3
    assert metrics.sim_gpu_utilization == 0.375
    assert parse_engine_metrics(V1_PAGE).sim_gpu_memory_total_bytes is None


@pytest.mark.parametrize("page", ["", "# HELP nothing here\n", SIM_GPU_LINES])
def test_missing_families_are_unknown_not_zero(page: str) -> None:
    metrics = parse_engine_metrics(page)
    assert metrics.running is None and metrics.waiting is None and metrics.kv_usage is None
    assert metrics.kv_capacity_tokens is None and metrics.ttft_count is None


def test_new_kv_gauge_wins_when_both_names_are_exported() -> None:
    page = ('vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
            'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25\n')
    assert parse_engine_metrics(page).kv_usage == 0.5


@pytest.mark.parametrize(("labels", "expected"), [
    ('block_size="16",num_gpu_blocks="None"', None),
    ('block_size="16"', None),
    ('block_size="0",num_gpu_blocks="10"', None),
    ('block_size="16.0",num_gpu_blocks="10"', 160),
])
def test_cache_config_without_usable_geometry(labels: str, expected: int | None) -> None:
    page = f'vllm:cache_config_info{{{labels}}} 1.0\n'
    assert parse_engine_metrics(page).kv_capacity_tokens == expected


def test_several_model_names_sum_unless_one_is_chosen() -> None:
    page = ('vllm:num_requests_running{engine="0",model_name="base"} 2.0\n'
            'vllm:num_requests_running{engine="0",model_name="other"} 5.0\n'
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n')
    assert parse_engine_metrics(page).running == 7
    chosen = parse_engine_metrics(page, model_name="base")
    assert chosen.running == 2
    assert chosen.kv_capacity_tokens == 1600  # series without a model_name label still count


@pytest.mark.parametrize("usage", ["1.7", "-0.2"])
def test_kv_usage_is_clamped(usage: str) -> None:
    page = f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage}\n'
    assert parse_engine_metrics(page).kv_usage in (0.0, 1.0)


@pytest.mark.parametrize("page", ["<html>502 Bad Gateway</html>", 'vllm:num_requests_running{engine="0" 1\n'])
def test_malformed_page_raises_one_error_type(page: str) -> None:
    with pytest.raises(MetricsFormatError):
        parse_engine_metrics(page)
