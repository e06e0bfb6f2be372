"""A LoRA adapter named in the configuration is served through Envoy by a stack started as users start it:
the controller launches its base's workers able to load adapters at run time and loads it on them."""

from __future__ import annotations

import time

import openai
import pytest

from tests.e2e.conftest import E2E_CONFIG, poolgate_up

pytestmark = pytest.mark.e2e


def test_a_configured_adapter_is_loaded_and_served_with_no_launch_flags_given(redis_server: object) -> None:
    config = {**E2E_CONFIG, "key_prefix": "e2e-lora", "pools": [{"name": "chat", "model": "chat-model"}],
              "workers": [{"id": "lora-a", "pool": "chat"}],
              "catalogue": {"adapter_sync_s": 0.5,
                            "adapters": [{"name": "sql", "base": "chat-model", "path": "/adapters/sql"}]}}
    with poolgate_up(config, redis_server.url) as stack:  # type: ignore[attr-defined]
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0)
        started, answer = time.monotonic(), None
        while answer is None:
            try:
                answer = client.completions.create(model="sql", prompt="select 1", max_tokens=2)
            except openai.APIStatusError:
                assert time.monotonic() - started < 30, "the adapter was never served"
                time.sleep(0.2)
        print(f"adapter served {time.monotonic() - started:.2f} s after the stack was ready")
        assert answer.model == "sql" and answer.choices[0].text
        client.close()
