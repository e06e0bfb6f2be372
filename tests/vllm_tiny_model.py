"""Build the tiny model real vLLM serves in the tests, offline: a random-weight Llama and a byte-level BPE tokenizer
trained here, with a Llama-3-style Jinja chat template.

Run with the vLLM venv's Python (it has torch, safetensors and tokenizers): ``python tests/vllm_tiny_model.py DIR``.
Nothing is downloaded: the tokenizer learns from the Python standard library's own sources, the weights are
drawn from a seeded generator, so one Python and torch release give the same model every time.

The shape (hidden 256, 2 layers, 4 query / 2 KV heads, vocab 4096) makes a model that loads in seconds and runs
~2k tokens/s on two CPU cores, while exercising everything poolgate relies on: grouped-query attention, a KV
cache in 128-token blocks, prefix caching and its events, the chat template.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

BOS, EOT, EOS = "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"
SPECIALS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", EOT]
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
"""Llama 3's template, trimmed of its tool and date parts: BOS before the first message, role headers, and
``| trim`` on each message's content (what makes a naive format string tokenise differently)."""

VOCAB = 4096
MAX_POSITIONS = 4096
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": VOCAB, "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False,
    "mlp_bias": False,
}
CORPUS_MODULES = ("argparse.py", "textwrap.py", "string.py", "json/encoder.py", "json/decoder.py", "csv.py",
                  "difflib.py", "pprint.py", "calendar.py", "fractions.py", "shlex.py", "dataclasses.py")


def build_tokenizer(directory: Path) -> dict[str, int]:
    """``tokenizer.json`` (with a post-processor that puts BOS first, as Llama 3's does) and
    ``tokenizer_config.json`` (with the chat template); the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = [(stdlib / name).read_text(encoding="utf-8") for name in CORPUS_MODULES]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIALS}
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, ids[BOS])])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOT, "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MAX_POSITIONS, "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
    }, indent=1))
    (directory / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOT}))
    return ids


def build_weights(directory: Path) -> None:
    """``model.safetensors``: every Llama tensor of ``CONFIG``'s shape, normal(0, 0.02), norms at 1."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    hidden, inter, head_dim = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["head_dim"]
    q_dim = CONFIG["num_attention_heads"] * head_dim  # type: ignore[operator]
    kv_dim = CONFIG["num_key_value_heads"] * head_dim  # type: ignore[operator]

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(VOCAB, hidden), "lm_head.weight": normal(VOCAB, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for layer in range(CONFIG["num_hidden_layers"]):  # type: ignore[call-overload]
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "self_attn.q_proj.weight": normal(q_dim, hidden),
            prefix + "self_attn.k_proj.weight": normal(kv_dim, hidden),
            prefix + "self_attn.v_proj.weight": normal(kv_dim, hidden),
            prefix + "self_attn.o_proj.weight": normal(hidden, q_dim),
            prefix + "mlp.gate_proj.weight": normal(inter, hidden),
            prefix + "mlp.up_proj.weight": normal(inter, hidden),
            prefix + "mlp.down_proj.weight": normal(hidden, inter),
            prefix + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def build(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(directory)
    config = {**CONFIG, "bos_token_id": ids[BOS], "eos_token_id": [ids[EOT], ids[EOS]]}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids[BOS], "eos_token_id": [ids[EOT], ids[EOS]]}))
    build_weights(directory)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/vllm_tiny_model.py DIRECTORY")
    build(Path(sys.argv[1]))
