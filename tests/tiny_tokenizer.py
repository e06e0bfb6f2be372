"""A tiny model directory's tokenizer, made offline: a byte-level BPE trained here on a few strings, with a
Llama-3-style Jinja chat template (BOS on the first message, role headers, ``| trim`` on each message) in its
``tokenizer_config.json``, as the real vLLM captures in ``tests/fixtures/vllm-0.32-cpu`` were served with."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tests.vllm_tiny_model import CHAT_TEMPLATE

BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"
SPECIALS = [BOS, "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", EOS]
LLAMA3_TEMPLATE = CHAT_TEMPLATE
"""The real-vLLM tiny model's template (``tests/vllm_tiny_model.py``): one declaration for both."""
TRAINING_TEXT = [
    "You are a helpful assistant. Answer briefly and precisely.",
    "What is the capital of France? Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog, again and again.",
    "  leading and trailing spaces  \n\n tabs\tand newlines\n",
]


def make_tiny_tokenizer(directory: Path, template: str | None = LLAMA3_TEMPLATE) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with ``template`` unless None) into
    ``directory``; the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                             special_tokens=[(BOS, bos_id)])
    tokenizer.save(str(directory / "tokenizer.json"))
    config: dict[str, object] = {"bos_token": BOS, "eos_token": {"content": EOS, "special": True},
                                 "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def encode(directory: Path, text: str, add_special_tokens: bool = False) -> list[int]:
    """The ids ``text`` encodes to with the directory's tokenizer (the engine's step after rendering)."""
    return list(Tokenizer.from_file(str(directory / "tokenizer.json")).encode(
        text, add_special_tokens=add_special_tokens).ids)
