"""The simulated worker's model kinds (vLLM's --runner / --convert), the pooled vectors and audio costs."""

from __future__ import annotations

import argparse
import base64
import io
import struct
import wave

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poolgate.kernel import audio_clip
from simworker import model_tasks
from simworker import pooling_protocol as wire
from simworker.cli import add_arguments, worker_specs
from simworker.protocol import WorkerApiError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(("argv", "runner", "convert"), [
    ((), "generate", "none"),
    (("--runner", "pooling"), "pooling", "embed"),
    (("--convert", "embed"), "pooling", "embed"),
    (("--convert", "classify"), "pooling", "classify"),
    (("--runner", "pooling", "--convert", "classify"), "pooling", "classify"),
])
def test_auto_resolves_as_vllm_does(argv: tuple[str, ...], runner: str, convert: str) -> None:
    tasks = worker_specs(parse(*argv))[0].tasks
    assert (tasks.runner, tasks.convert) == (runner, convert)


@pytest.mark.parametrize("argv", [
    ("--runner", "generate", "--convert", "embed"),
    ("--runner", "pooling", "--convert", "none"),
    ("--runner", "pooling", "--transcription"),
    ("--embedding-dim", "0"),
])
def test_contradictory_flags_are_refused(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="--"):
        model_tasks.from_args(parse(*argv))


@pytest.mark.parametrize(("tasks", "served", "refused"), [
    (model_tasks.ModelTasks(), {"/v1/chat/completions", "/v1/responses"},
     {"/v1/embeddings", "/score", "/v2/rerank", "/v1/audio/transcriptions"}),
    (model_tasks.ModelTasks(transcription=True), {"/v1/audio/translations", "/v1/completions"}, {"/rerank"}),
    (model_tasks.ModelTasks("pooling", "embed"), {"/v1/embeddings", "/v1/score", "/rerank"},
     {"/v1/chat/completions", "/v1/responses"}),
    (model_tasks.ModelTasks("pooling", "classify"), {"/score", "/v1/rerank"}, {"/v1/embeddings", "/v1/completions"}),
])
def test_refusals_follow_the_model_kind(tasks: model_tasks.ModelTasks, served: set[str], refused: set[str]) -> None:
    assert all(tasks.refusal(path) is None for path in served | {"/tokenize", "/detokenize", "/v1/models"})
    assert all((tasks.refusal(path) or "").startswith("The model does not support ") for path in refused)


@given(st.lists(st.text(alphabet="abcdefgh ", min_size=1, max_size=30), min_size=1, max_size=5),
       st.integers(1, 64))
def test_vectors_are_unit_length_and_deterministic(texts: list[str], dimensions: int) -> None:
    for text in texts:
        sequence = tuple(text.split()) or ("x",)
        vector = wire.truncated(wire.embed(sequence, 64), dimensions)
        assert len(vector) == dimensions
        assert sum(x * x for x in vector) == pytest.approx(1.0)
        assert vector == wire.truncated(wire.embed(sequence, 64), dimensions)


def test_base64_is_little_endian_float32() -> None:
    encoded = wire.encode_base64([1.0, -0.5])
    assert struct.unpack("<2f", base64.b64decode(encoded)) == (1.0, -0.5)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 65}, "dimensions"),
    ({"input": "x", "model": 3}, "model"),
])
def test_bad_embedding_requests_name_the_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(WorkerApiError) as caught:
        wire.parse_embeddings(body, 64)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_score_pairs_one_to_many_and_many_to_many() -> None:
    assert len(wire.parse_score({"text_1": "q", "text_2": ["a", "b", "c"]}).pairs) == 3
    assert len(wire.parse_score({"text_1": ["q", "r"], "text_2": ["a", "b"]}).pairs) == 2
    with pytest.raises(WorkerApiError):
        wire.parse_score({"text_1": ["q", "r"], "text_2": ["a", "b", "c"]})


def _wav(seconds: float, rate: int, channels: int = 1) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(b"\0\0" * channels * int(seconds * rate))
    return buffer.getvalue()


@pytest.mark.parametrize(("data", "seconds"), [
    (_wav(2.5, 16_000), 2.5), (_wav(1.0, 44_100, 2), 1.0), (b"ID3" + b"\0" * 31_997, 2.0),
])
def test_audio_duration_from_header_or_rate(data: bytes, seconds: float) -> None:
    assert audio_clip.audio_duration_s(data) == pytest.approx(seconds)


def test_audio_is_cut_in_whisper_chunks() -> None:
    jobs = audio_clip.chunk_costs(65.0)
    assert [prompt for prompt, _ in jobs] == [1504, 1504, 1504]
    assert [output for _, output in jobs] == [90, 90, 15]
