"""LoRA facts from vLLM's ``vllm:lora_requests_info``: the newest series wins, into the worker record."""

from __future__ import annotations

from agent.live import live_fields
from agent.rates import RateState
from agent.vllm_metrics import parse_engine_metrics
from poolgate.kernel.fleet import WorkerRecord

PAGE = """# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters="sql,math"} 1.8e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.75e9
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="base"} 2.0
"""


def test_newest_series_gives_running_then_waiting_adapters() -> None:
    metrics = parse_engine_metrics(PAGE, "base")
    assert metrics.lora_adapters == ("sql", "chat", "math") and metrics.max_loras == 4
    assert metrics.running == 2


def test_absent_metric_is_unknown_and_writes_nothing() -> None:
    metrics = parse_engine_metrics(PAGE.split("# HELP vllm:num_requests_running")[0].replace("lora", "x"))
    assert metrics.lora_adapters is None
    assert "lora_adapters" not in live_fields(metrics, RateState(), None)


def test_record_round_trips_the_adapters_through_redis_fields() -> None:
    fields = live_fields(parse_engine_metrics(PAGE), RateState(), None)
    record = WorkerRecord(id="w", pool="p", model="base", host="h", port=1)
    raw = {**record.to_redis(), **{k: str(v) for k, v in fields.items()}}
    back = WorkerRecord.from_redis(raw)
    assert back.lora_adapters == ("sql", "chat", "math") and back.max_loras == 4
