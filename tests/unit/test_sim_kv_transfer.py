"""The simulator's KV-transfer protocol (``--kv-transfer-config``), on virtual time: what a producer holds and
for how long, what a decode request's params must say, the transfer's cost, and a decode that skips prefill."""

from __future__ import annotations

import pytest

from simworker.engine import Engine, EngineConfig, EngineRequest
from simworker.kv_transfer import (
    NVLINK_GB_PER_S,
    RDMA_GB_PER_S,
    TRANSFER_SETUP_S,
    KVTransferConfig,
    ProducerBlocks,
    RemoteDecodeAsk,
    RemotePrefill,
    TransferParamsError,
    read_params,
    transfer_seconds,
)
from simworker.presets import PRESETS, ModelShape, step_cost

LLAMA_8B = ModelShape()


def test_config_reads_vllm_fields_and_the_simulators_knobs() -> None:
    config = KVTransferConfig.from_json(
        '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer",'
        ' "kv_connector_extra_config": {"sim_link_gb_per_s": 450, "sim_abort_timeout_s": 30}}')
    assert (config.kv_connector, config.kv_role, config.link_gb_per_s, config.abort_timeout_s) == (
        "NixlConnector", "kv_consumer", 450.0, 30.0)
    assert config.consumes and not config.produces
    both = KVTransferConfig.from_json('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    assert both.consumes and both.produces and both.link_gb_per_s == RDMA_GB_PER_S


@pytest.mark.parametrize(("text", "field"), [
    ("[]", "JSON object"),
    ('{"kv_role": "kv_both"}', "kv_connector"),
    ('{"kv_connector": "NixlConnector", "kv_role": "prefill"}', "kv_role"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_connector_extra_config": '
     '{"sim_link_gb_per_s": 0}}', "sim_link_gb_per_s"),
])
def test_config_errors_name_the_field(text: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KVTransferConfig.from_json(text)


def test_transfer_time_is_bytes_over_bandwidth() -> None:
    per_token = LLAMA_8B.kv_bytes_per_token  # 128 KiB in fp16 for Llama-3-8B
    assert per_token == 131072
    rdma = transfer_seconds(10_000, per_token, RDMA_GB_PER_S)
    assert rdma == pytest.approx(TRANSFER_SETUP_S + 10_000 * 131072 / 50e9)  # 1.31 GB: ~26 ms
    assert transfer_seconds(10_000, per_token, NVLINK_GB_PER_S) < rdma / 6
    # the transfer costs far less than the prefill it replaces (10k tokens on an H100: ~0.39 s modelled)
    prefill = step_cost(PRESETS["h100-80gb"], LLAMA_8B).step_seconds(10_000, 0, 10_000 * 10_001 // 2)
    assert rdma < prefill / 10


def test_proxy_ask_and_producer_params_are_read_as_the_two_steps() -> None:
    ask = {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    assert read_params(ask) == RemoteDecodeAsk()
    blocks = ProducerBlocks(block_size=16, abort_timeout_s=480)
    held = blocks.hold("cmpl-1", 40, now=0.0)
    params = blocks.params(held, "engine-p", "10.0.0.5", 8100)
    assert params == {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-p",
                      "remote_request_id": "cmpl-1", "remote_block_ids": [0, 1, 2], "remote_host": "10.0.0.5",
                      "remote_port": 8100, "tp_size": 1}
    assert read_params({"kv_transfer_params": params}) == RemotePrefill("engine-p", "cmpl-1", (0, 1, 2),
                                                                       "10.0.0.5", 8100)
    assert read_params({"model": "m"}) is None


@pytest.mark.parametrize("params", [
    "yes",
    {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r", "remote_block_ids": "0,1",
     "remote_host": "h", "remote_port": 1},
    {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r", "remote_block_ids": [0],
     "remote_host": "h"},
])
def test_malformed_params_are_refused(params: object) -> None:
    with pytest.raises(TransferParamsError):
        read_params({"kv_transfer_params": params})


def test_producer_keeps_blocks_until_read_or_timeout() -> None:
    blocks = ProducerBlocks(block_size=16, abort_timeout_s=10)
    first = blocks.hold("a", 33, now=0.0)
    second = blocks.hold("b", 16, now=1.0)
    assert first.block_ids == (0, 1, 2) and second.block_ids == (3,)  # never reused while held
    assert blocks.claim("a", (0, 1), now=2.0) == "wrong_blocks"
    assert blocks.claim("never", (), now=2.0) == "unknown"
    assert blocks.claim("a", first.block_ids, now=2.0) == first
    assert blocks.claim("a", first.block_ids, now=3.0) == first  # a reader died mid-read: read again
    assert blocks.done("a")
    assert blocks.claim("a", first.block_ids, now=4.0) == "unknown"  # read to the end: freed
    assert blocks.claim("b", second.block_ids, now=10.9) == second
    assert blocks.claim("b", second.block_ids, now=11.0) == "expired"  # 10 s after its prefill, unread
    assert blocks.held == 0


def test_decode_with_remote_kv_skips_the_prefill() -> None:
    config = EngineConfig(num_gpu_blocks=4000, block_size=16, max_num_seqs=64, max_num_batched_tokens=2048,
                          max_model_len=16384, enable_prefix_caching=True,
                          cost=step_cost(PRESETS["h100-80gb"], LLAMA_8B))

    def first_token_s(remote_tokens: int) -> float:
        engine, now = Engine(config), 0.0
        engine.add_request(EngineRequest("r", 8000, 4, "length", remote_computed_tokens=remote_tokens), now)
        while True:
            outcome = engine.step(now)
            now = outcome.end
            if outcome.first_token_times:
                return outcome.first_token_times[0][1]

    local = first_token_s(0)
    remote = first_token_s(7999)
    assert local > 0.2  # four 2k-token chunks of prefill (~0.32 s modelled)
    assert remote < 0.05  # one step: the last prompt token and the first output token
    assert remote < local / 20
