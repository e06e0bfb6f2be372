"""The pool tokenizer renders the model's own Jinja chat template, as vLLM does, so extproc's token ids are the
engine's.

Seen against a real vLLM (a Llama-3-style template with ``| trim``): format strings tokenised one prompt in
four differently, by the spaces at either end of a message. The expected texts below are what ``transformers``
(vLLM's renderer) makes of this template: BOS once, each message trimmed, the assistant header to prime the
answer unless ``add_generation_prompt`` is false.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import pytest

from extproc.kvcache.chat_template import JinjaChatTemplate, load_chat_template
from extproc.kvcache.tokenizer import ChatTemplate, LocalTokenizer, TokenizerError, prompt_token_ids
from extproc.kvcache.wiring import pool_tokenizers
from poolgate.kernel.config import ConfigError, PoolSpec
from tests.tiny_tokenizer import BOS, encode, make_tiny_tokenizer

H = "<|start_header_id|>{}<|end_header_id|>\n\n"
REPLY = H.format("assistant")


def turn(role: str, text: str) -> str:
    return H.format(role) + text + "<|eot_id|>"


CHATS: list[tuple[str, dict[str, Any], str]] = [
    ("system, user and assistant turns",
     {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                   {"role": "user", "content": "What is the capital of France?"},
                   {"role": "assistant", "content": "Paris."},
                   {"role": "user", "content": "And of Italy?"}]},
     BOS + turn("system", "You are a helpful assistant.") + turn("user", "What is the capital of France?")
     + turn("assistant", "Paris.") + turn("user", "And of Italy?") + REPLY),
    ("whitespace at either end",
     {"messages": [{"role": "user", "content": "  leading and trailing spaces \n\n"}]},
     BOS + turn("user", "leading and trailing spaces") + REPLY),
    ("multi-part content",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "def add(a, b):"},
                                                {"type": "text", "text": "  return a + b  "}]}]},
     BOS + turn("user", "def add(a, b):\n  return a + b") + REPLY),
    ("no generation prompt",
     {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False},
     BOS + turn("user", "Hi")),
    ("a null content",
     {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]},
     BOS + turn("user", "Hi") + turn("assistant", "") + REPLY),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize(("shape", "body", "rendered"), CHATS, ids=[c[0] for c in CHATS])
def test_chat_token_ids_are_the_engines(model_dir: Path, shape: str, body: dict[str, Any], rendered: str) -> None:
    tokenizer = LocalTokenizer(str(model_dir))
    assert prompt_token_ids(body, tokenizer) == encode(model_dir, rendered)


def test_completions_get_the_bos_the_engine_adds(model_dir: Path) -> None:
    tokenizer = LocalTokenizer(str(model_dir / "tokenizer.json"))  # the file: its directory holds the template
    ids = prompt_token_ids({"prompt": "  The quick brown fox "}, tokenizer)
    assert ids == encode(model_dir, "  The quick brown fox ", add_special_tokens=True)
    assert ids is not None and ids[0] == encode(model_dir, BOS)[0]


def test_the_format_strings_the_pool_gave_before_missed_the_trim(model_dir: Path) -> None:
    """What the old path made of the whitespace prompt: not the engine's ids."""
    old = ChatTemplate(message=H.replace("{}", "{role}") + "{content}<|eot_id|>", reply=REPLY, prefix=BOS)
    body = CHATS[1][1]
    assert old.render([("user", body["messages"][0]["content"])]) != CHATS[1][2]
    assert prompt_token_ids(body, LocalTokenizer(str(model_dir), old)) == encode(model_dir, CHATS[1][2])


def test_format_strings_still_serve_a_model_without_a_template(tmp_path: Path) -> None:
    directory = make_tiny_tokenizer(tmp_path, template=None)
    fallback = ChatTemplate(message="[{role}] {content}\n", reply="[assistant] ")
    tokenizer = LocalTokenizer(str(directory), fallback)
    assert not tokenizer.uses_model_template
    body = {"messages": [{"role": "user", "content": " Hi "}]}
    assert prompt_token_ids(body, tokenizer) == encode(directory, "[user]  Hi \n[assistant] ")
    with pytest.raises(TokenizerError, match="no chat template beside"):
        LocalTokenizer(str(directory))


def test_a_pool_tokenizer_needs_no_format_strings_when_the_model_has_a_template(model_dir: Path,
                                                                             tmp_path: Path) -> None:
    pools = (PoolSpec(name="chat", model="tiny", tokenizer={"path": str(model_dir)}),)  # type: ignore[arg-type]
    assert isinstance(pool_tokenizers(pools)["chat"], LocalTokenizer)
    bare = make_tiny_tokenizer(tmp_path / "bare", template=None)
    pools = (PoolSpec(name="chat", model="tiny", tokenizer={"path": str(bare)}),)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"pools\[0\].tokenizer.path: no chat template .* message/reply/prefix"):
        pool_tokenizers(pools)


def test_named_templates_a_jinja_file_and_the_request_switches(tmp_path: Path) -> None:
    directory = make_tiny_tokenizer(tmp_path, template=None)
    config = (directory / "tokenizer_config.json")
    config.write_text(config.read_text().replace(
        '"model_max_length"', '"chat_template": [{"name": "tool_use", "template": "T"}, '
        '{"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content }};{% endfor %}'
        '{% if thinking %}think{% endif %}"}], "model_max_length"'))
    template = load_chat_template(directory)
    assert template is not None
    assert template.render([{"role": "user", "content": "a"}], template_kwargs={"thinking": True}) == f"{BOS}a;think"
    (directory / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{% endfor %}")
    template = load_chat_template(directory)  # the separate file wins, as in transformers
    assert template is not None and template.render([{"role": "user", "content": "a"}]) == "<user>"


def test_continue_final_message_ends_the_prompt_at_the_partial_answer(model_dir: Path) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Paris is "}],
            "add_generation_prompt": False, "continue_final_message": True}
    ids = prompt_token_ids(body, LocalTokenizer(str(model_dir)))
    assert ids == encode(model_dir, BOS + turn("user", "Hi") + H.format("assistant") + "Paris is")


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
])
def test_bodies_the_router_cannot_render_exactly_are_left_to_the_estimate(model_dir: Path,
                                                                         body: dict[str, Any]) -> None:
    assert prompt_token_ids(body, LocalTokenizer(str(model_dir))) is None


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__ }}",
    "{% for m in messages %}{{ m.__class__.__init__.__globals__ }}{% endfor %}",
    "{{ messages.append(1) }}",
])
def test_the_template_runs_sandboxed(source: str) -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        JinjaChatTemplate(source, {}).render([{"role": "user", "content": "x"}])


def test_a_template_that_refuses_a_role_raises_its_message() -> None:
    template = JinjaChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}"
                                 "{% endif %}ok", {})
    with pytest.raises(jinja2.exceptions.TemplateError, match="user first"):
        template.render([{"role": "assistant", "content": "x"}])


def test_generation_blocks_and_tojson_render_as_in_transformers() -> None:
    template = JinjaChatTemplate("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                                 "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}|"
                                 "{% endfor %}{{ extra | tojson }}", {})
    rendered = template.render([{"role": "user", "content": "é"}, {"role": "assistant", "content": "b"}],
                               template_kwargs={"extra": {"k": "é"}})
    assert rendered == 'é|b|{"k": "é"}'  # tojson keeps non-ASCII text, as transformers' filter does
