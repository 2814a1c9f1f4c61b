"""The load generator's chats against a fake vLLM served with its parsers: judged by the message each assembles to."""

from __future__ import annotations

import asyncio
import dataclasses

from simulate.chats import Chats
from simulate.fakes.engine import EngineConfig
from simulate.load import Load
from simulate.timeline import Outcome, Recorder
from tests.conftest import running_engine

CHATS = Chats(reasoning_tokens=30)
THINKING = EngineConfig(
    tokens_per_s=1000,
    reasoning_parser="deepseek_r1",
    tool_call_parser="hermes",
    auto_tool_choice=True,
    reasoning_tokens=CHATS.reasoning_tokens,
)


async def outcomes(config: EngineConfig, *, length_s: float) -> list[tuple[Outcome, int, int]]:
    """The chats of two slots straight to the engine, for a moment: (outcome, tokens asked for, tokens received)."""
    recorder = Recorder(asyncio.get_running_loop().time)
    async with running_engine(config) as port:
        load = Load(
            f"http://127.0.0.1:{port}", recorder, slots=2, length_s=lambda _: length_s, tokens_per_s=1000, hops={}
        )
        load.chats = CHATS
        running = asyncio.create_task(load.run())
        await asyncio.sleep(0.05)
        load.stopping.set()  # no slot opens another; the open ones run to their end
        await asyncio.wait_for(running, 30)
    return sorted((r.outcome, r.wanted, r.received) for r in recorder.streams)


async def test_a_long_chat_reasons_answers_and_calls_to_its_end_and_a_short_one_ends_by_its_length() -> None:
    long, short = await outcomes(THINKING, length_s=1.0), await outcomes(THINKING, length_s=0.01)
    assert {o for o, _, _ in long + short} == {Outcome.COMPLETED}
    assert all(received < wanted for _, wanted, received in long)  # ended by the model, past its reasoning
    assert all(received > CHATS.reasoning_tokens for _, _, received in long)
    assert all(received == wanted == 10 for _, wanted, received in short)


async def test_a_chat_that_does_not_assemble_to_the_uninterrupted_message_counts_as_cut() -> None:
    """An engine that reasons a token longer than the load expects: every stream ends well, none is the message."""
    other = dataclasses.replace(THINKING, reasoning_tokens=CHATS.reasoning_tokens + 1)
    assert {o for o, _, _ in await outcomes(other, length_s=1.0)} == {Outcome.CUT}
