"""GPU sources: dcgm-exporter pages and Prometheus answers parsed into readings, workers matched to GPUs,
pacing and failures of a polled source, and the config that picks one."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson
import pytest

from agent.gpu_sources.choose import open_gpu_source
from agent.gpu_sources.dcgm import parse_dcgm_page
from agent.gpu_sources.dcgm_series import Series, reading_from_series
from agent.gpu_sources.polled import GpuSourceError, HttpText, PolledSource
from agent.gpu_sources.prometheus import gpu_query, parse_query_reply
from agent.gpu_sources.reading import LOCAL_NODE, NO_GPUS, GpuReading
from agent.gpus import GpuSample
from poolgate.kernel.config import AgentSettings, ConfigError, parse_config
from tests.manual_clock import ManualClock
from tests.standin_dcgm_exporter import StandInGpu, dcgm_page

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm-exporter-two-gpus.txt"
UUID_0 = "GPU-5f0c2a1e-77b3-4c0d-9a51-0c2b1f6d8e01"
UUID_1 = "GPU-9a7e4b22-1d3f-4e8a-b0c6-5e2d7f9a1b02"
WORKER_POD = ("poolgate", "pg-chat-5c9d7-x2kqp")
NO_POD = ("poolgate", "absent")


def gauge(name: str, value: float, gpu: str = "0", uuid: str = "GPU-a", **labels: str) -> Series:
    return Series(name, {"gpu": gpu, "UUID": uuid, **labels}, value)


def gpu_series(free: float, used: float, util: float, **labels: str) -> list[Series]:
    return [gauge("DCGM_FI_DEV_FB_FREE", free, **labels), gauge("DCGM_FI_DEV_FB_USED", used, **labels),
            gauge("DCGM_FI_DEV_GPU_UTIL", util, **labels)]


def test_exporter_page_gives_memory_utilisation_and_pods() -> None:
    reading = parse_dcgm_page(FIXTURE.read_text())
    assert set(reading.nodes) == {LOCAL_NODE}
    first, second = reading.nodes[LOCAL_NODE][0], reading.nodes[LOCAL_NODE][1]
    assert (first.uuid, first.memory_free_mib, first.memory_used_mib) == (UUID_0, 19350.0, 61570.0)
    assert first.memory_total_mib == 19350 + 61570 + 639  # free + used + reserved
    assert first.utilization == pytest.approx(0.87)  # GPU_UTIL is in percent
    assert (second.uuid, second.memory_free_mib, second.utilization) == (UUID_1, 80920.0, 0.0)
    # GPU 0 is time-sliced between two pods; GPU 1 is held by none.
    assert reading.pods == {WORKER_POD: (UUID_0,), ("research", "notebook-0"): (UUID_0,)}


def test_worker_gpus_by_pod_labels_by_uuid_and_by_index() -> None:
    reading = parse_dcgm_page(FIXTURE.read_text())
    by_pod = reading.summary_for((), node="", pod=WORKER_POD)
    assert by_pod is not None and by_pod.memory_free_mib == 19350.0
    both = reading.summary_for((0, UUID_1), node="", pod=NO_POD)
    assert both is not None
    assert (both.memory_free_mib, both.utilization) == (19350.0 + 80920.0, pytest.approx(0.435))
    configured = reading.summary_for([1], node="", pod=WORKER_POD)  # configured ids win over pod labels
    assert configured is not None and configured.memory_free_mib == 80920.0
    assert reading.summary_for((), node="", pod=NO_POD) is None  # names no GPU
    assert reading.summary_for([0, 7], node="", pod=NO_POD) is None  # one of its GPUs is not in the reading


def test_the_stand_in_exporter_speaks_the_fixture_format() -> None:
    page = dcgm_page("node-a", [StandInGpu(3, "GPU-x", 100.0, 50.0, 40, pods=[("ns", "p")])])
    reading = parse_dcgm_page(page)
    assert reading.nodes[LOCAL_NODE][3].memory_total_mib == 100 + 50 + 512
    assert reading.pods == {("ns", "p"): ("GPU-x",)}


def test_fleet_reading_matches_an_index_only_on_the_workers_node() -> None:
    reading = reading_from_series(
        [*gpu_series(100, 10, 50, uuid="GPU-a", Hostname="node-a"),
         *gpu_series(200, 20, 10, uuid="GPU-b", Hostname="node-b"),
         *gpu_series(300, 30, 10, uuid="GPU-c")],  # no node label: cannot be placed
        node_label="Hostname")
    assert set(reading.nodes) == {"node-a", "node-b"}
    summary = reading.summary_for([0], node="node-b", pod=NO_POD)
    assert summary is not None and summary.memory_free_mib == 200.0
    assert reading.summary_for([0], node="", pod=NO_POD) is None  # an index without a node names nothing
    by_uuid = reading.summary_for(["GPU-a"], node="", pod=NO_POD)
    assert by_uuid is not None and by_uuid.memory_free_mib == 100.0


@pytest.mark.parametrize(("series", "expected"), [
    ([gauge("DCGM_FI_DEV_FB_FREE", 10), gauge("DCGM_FI_DEV_FB_USED", 5),
      gauge("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0.25)], (15.0, 0.25)),  # profiling ratio when GPU_UTIL is absent
    ([*gpu_series(10, 5, 50), gauge("DCGM_FI_DEV_FB_TOTAL", 20)], (20.0, 0.5)),  # FB_TOTAL when exported
    ([*gpu_series(10, 5, 150)], (15.0, 1.0)),  # utilisation clamped
])
def test_memory_total_and_utilisation(series: list[Series], expected: tuple[float, float]) -> None:
    sample = reading_from_series(series).nodes[LOCAL_NODE][0]
    assert (sample.memory_total_mib, sample.utilization) == expected


@pytest.mark.parametrize("series", [
    [gauge("DCGM_FI_DEV_FB_FREE", 10), gauge("DCGM_FI_DEV_FB_USED", 5)],  # no utilisation
    [gauge("DCGM_FI_DEV_FB_FREE", 10), gauge("DCGM_FI_DEV_GPU_UTIL", 5)],  # no used memory
    gpu_series(10, 5, 50, GPU_I_ID="3", GPU_I_PROFILE="1g.10gb"),  # a MIG slice
    [gauge("DCGM_FI_DEV_FB_FREE", float("nan")), *gpu_series(10, 5, 50)[1:]],  # NaN is no value
    [Series("DCGM_FI_DEV_FB_FREE", {"UUID": "GPU-a"}, 1.0)],  # no gpu index
])
def test_incomplete_gpus_are_left_out(series: list[Series]) -> None:
    assert reading_from_series(series).gpu_count == 0


def test_garbled_page_is_a_source_error() -> None:
    with pytest.raises(GpuSourceError, match="not Prometheus text"):
        parse_dcgm_page('DCGM_FI_DEV_FB_FREE{gpu="0" 12\n')


def query_answer(*series: tuple[dict[str, str], str]) -> bytes:
    result = [{"metric": labels, "value": [1764580000.123, value]} for labels, value in series]
    return orjson.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})


def test_prometheus_answer_is_a_fleet_reading() -> None:
    labels = {"gpu": "1", "UUID": "GPU-b", "Hostname": "node-b", "job": "dcgm", "instance": "10.0.0.2:9400",
              "namespace": "gpu-operator", "pod": "nvidia-dcgm-exporter-x7",  # the exporter's own pod ...
              "exported_namespace": "poolgate", "exported_pod": "pg-chat-1"}  # ... and the GPU's holder
    body = query_answer(({**labels, "__name__": "DCGM_FI_DEV_FB_FREE"}, "1024"),
                        ({**labels, "__name__": "DCGM_FI_DEV_FB_USED"}, "3072"),
                        ({**labels, "__name__": "DCGM_FI_DEV_GPU_UTIL"}, "25"),
                        ({"__name__": "DCGM_FI_DEV_FB_FREE"}, "not a number"))
    reading = parse_query_reply(body, "Hostname")
    assert reading.nodes["node-b"][1].memory_free_mib == 1024.0
    assert reading.pods == {("poolgate", "pg-chat-1"): ("GPU-b",)}


@pytest.mark.parametrize(("body", "message"), [
    (b'{"status":"error","errorType":"bad_data","error":"parse error at char 3"}', "parse error at char 3"),
    (b'{"status":"success","data":{"resultType":"matrix","result":[]}}', "not an instant vector"),
    (b"<html>proxy error</html>", "not JSON"),
])
def test_prometheus_error_answers(body: bytes, message: str) -> None:
    with pytest.raises(GpuSourceError, match=message):
        parse_query_reply(body, "Hostname")


def test_one_query_names_every_series_a_reading_needs() -> None:
    query = gpu_query('job="dcgm-exporter",')
    assert query.startswith('{__name__=~"DCGM_FI_DEV_FB_FREE|DCGM_FI_DEV_FB_USED|')
    assert query.endswith(', job="dcgm-exporter"}')
    assert "DCGM_FI_DEV_GPU_UTIL" in gpu_query() and gpu_query().count(",") == 0


class ScriptedReads:
    def __init__(self) -> None:
        self.calls = 0
        self.fail = False
        self.reading = GpuReading(nodes={LOCAL_NODE: {0: GpuSample(0, "GPU-a", 10.0, 5.0, 5.0, 0.5)}})

    async def read_once(self) -> GpuReading:
        self.calls += 1
        if self.fail:
            raise GpuSourceError("connection refused")
        return self.reading


async def test_polled_source_reads_once_per_interval_and_survives_outages(caplog: pytest.LogCaptureFixture) -> None:
    reads, clock = ScriptedReads(), ManualClock(100.0)
    source = PolledSource("stand-in", reads.read_once, 1.0, HttpText(1.0), clock)
    assert await source.read() is reads.reading
    clock.now += 0.5
    assert await source.read() is reads.reading and reads.calls == 1  # within the interval: the last reading
    reads.fail = True
    with caplog.at_level(logging.WARNING, logger="poolgate.agent.gpu_sources"):
        for _ in range(3):
            clock.now += 1.0
            assert await source.read() is NO_GPUS  # facts it cannot vouch for are not served again
    assert source.failures == 3
    assert len([r for r in caplog.records if "cannot read GPUs from stand-in" in r.message]) == 1
    reads.fail = False
    clock.now += 1.0
    assert await source.read() is reads.reading
    await source.close()


def config(agent: dict[str, object]) -> AgentSettings:
    return parse_config({"pools": [{"name": "chat", "model": "m"}], "agent": agent}).agent


@pytest.mark.parametrize(("agent", "error"), [
    ({"gpu_source": "prometheus"}, "agent: gpu_source prometheus needs prometheus.url"),
    ({"gpu_source": "prometheus", "prometheus": {"url": "prometheus:9090"}}, "agent.prometheus.url: "),
    ({"prometheus": {"selector": "job=dcgm"}}, "agent.prometheus.selector: 'job=dcgm' is not a list of PromQL"),
    ({"dcgm": {"url": "ftp://node/metrics"}}, "agent.dcgm.url: "),
    ({"gpu_source": "dcgm-exporter"}, "agent.gpu_source"),
    ({"dcgm": {"interval_s": 0}}, "agent.dcgm.interval_s"),
])
def test_bad_gpu_source_settings_are_refused_at_load(agent: dict[str, object], error: str) -> None:
    with pytest.raises(ConfigError, match=error.replace(".", r"\.").replace("(", r"\(")):
        config(agent)


async def test_the_configured_source_is_opened() -> None:
    dcgm = await open_gpu_source(config({"gpu_source": "dcgm", "dcgm": {"url": "http://10.0.0.5:9400/metrics"}}))
    prometheus = await open_gpu_source(config({"gpu_source": "prometheus", "prometheus": {
        "url": "http://prometheus:9090/", "selector": 'job="dcgm-exporter"'}}))
    assert isinstance(dcgm, PolledSource) and dcgm.name == "dcgm-exporter http://10.0.0.5:9400/metrics"
    assert isinstance(prometheus, PolledSource) and prometheus.name == "Prometheus http://prometheus:9090/"
    assert await open_gpu_source(config({"gpu_source": "nvml", "nvml": "off"})) is None
    nvml = await open_gpu_source(config({}), open_nvml=lambda _: None)
    assert nvml is None
    for source in (dcgm, prometheus):
        await source.close()
