"""Natural output lengths over HTTP: the same request ends at the same length on any worker."""

from __future__ import annotations

from simworker.presets import PRESETS
from tests.conftest import StartSimWorker
from tests.integration.test_simworker_http import MODEL, client


async def test_two_different_workers_give_one_request_the_same_answer(start_simworker: StartSimWorker) -> None:
    workers = [await start_simworker(time_scale=100.0),
               await start_simworker(time_scale=100.0, preset=PRESETS["l4-24gb"])]
    answers = []
    for worker in workers:
        async with client(worker) as sdk:
            answer = await sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Explain prefix caching."}], max_tokens=2000)
        assert answer.usage is not None
        answers.append((answer.choices[0].finish_reason, answer.usage.completion_tokens,
                        answer.choices[0].message.content))
    assert answers[0] == answers[1]
    assert answers[0][0] == "stop" and answers[0][1] < 2000
