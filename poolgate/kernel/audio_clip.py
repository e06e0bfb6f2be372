"""How long an uploaded audio clip is, and how a Whisper-like model cuts it: shared by the router's cost
estimate and the simulated speech-to-text worker, so both count the same work.

vLLM's speech-to-text models (Whisper) take audio in 30 s chunks; each chunk is one engine request whose
encoder fills 1500 positions (its cross-attention KV) and whose decoder writes at most 448 tokens. Speech runs
near 150 words a minute, about 3 tokens a second. A WAV file's duration comes from its header (byte rate and
data size); any other (compressed) format is taken at 128 kbit/s, 16,000 bytes a second.
"""

from __future__ import annotations

import math
import struct

CHUNK_S = 30.0
ENCODER_POSITIONS_PER_CHUNK = 1500
TASK_TOKENS = 4
"""Decoder prompt of a chunk: start of transcript, language, task, no timestamps."""
OUTPUT_TOKENS_PER_S = 3.0
MAX_OUTPUT_PER_CHUNK = 448
COMPRESSED_BYTES_PER_S = 16_000


def audio_duration_s(data: bytes) -> float:
    """Seconds of audio in an uploaded file."""
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        offset, byte_rate = 12, 0
        while offset + 8 <= len(data):
            chunk_id, size = data[offset:offset + 4], struct.unpack_from("<I", data, offset + 4)[0]
            if chunk_id == b"fmt " and size >= 16 and offset + 16 <= len(data):
                byte_rate = struct.unpack_from("<I", data, offset + 16)[0]
            elif chunk_id == b"data" and byte_rate:
                return min(size, len(data) - offset - 8) / byte_rate
            offset += 8 + size + (size & 1)
    return len(data) / COMPRESSED_BYTES_PER_S


def chunk_costs(duration_s: float) -> list[tuple[int, int]]:
    """(prompt positions, output tokens) of each 30 s chunk: encoder positions plus task tokens, and about 3
    tokens per second of speech, capped at the decoder's length."""
    chunks = max(1, math.ceil(duration_s / CHUNK_S))
    costs = []
    for index in range(chunks):
        seconds = min(CHUNK_S, duration_s - index * CHUNK_S)
        output = max(1, min(MAX_OUTPUT_PER_CHUNK, math.ceil(seconds * OUTPUT_TOKENS_PER_S)))
        costs.append((ENCODER_POSITIONS_PER_CHUNK + TASK_TOKENS, output))
    return costs
