"""The reasoning-streams verdict: the chats a continuation left unequal to their uninterrupted message fail it."""

from __future__ import annotations

from simulate.chats import Assembly, Chats, Message, assemble
from simulate.scenarios import SCENARIOS, judge
from simulate.summary import summarize
from simulate.timeline import Kind, Outcome, StreamRecord
from tests.unit.test_simulation import MARKED_ONCE, PODS, STREAMS, drained_node, ev, stream

SCENARIO = SCENARIOS["reasoning-streams"]


def checks(*, streams: list[StreamRecord], continued: int) -> dict[str, bool]:
    events = drained_node(cut=(1, 0)) + [ev(12.0, Kind.CONTINUED)] * continued
    summary = summarize(events, streams, pods=PODS, facts=MARKED_ONCE)
    return {c.name: c.passed for c in judge(SCENARIO, summary, gateway=True)}


def test_through_the_gateway_every_chat_must_assemble_to_its_uninterrupted_message_and_some_continued() -> None:
    assert all(checks(streams=STREAMS, continued=1).values())
    unequal = [*STREAMS, stream(5, "spare-0", 3.0, 14.1, Outcome.CUT)]  # the load's record of a chat that differed
    failed = {name for name, passed in checks(streams=unequal, continued=1).items() if not passed}
    assert failed == {"no stream cut", "every chat assembled to its uninterrupted message"}
    assert not checks(streams=STREAMS, continued=0)["chats that outlived the notice were continued"]


def test_without_the_gateway_the_long_chats_are_cut_and_counted() -> None:
    cut = [*STREAMS, stream(5, "vllm-0", 3.0, 14.1, Outcome.CUT)]
    summary = summarize(drained_node(cut=(1, 0)), cut, pods=PODS, facts=MARKED_ONCE)
    assert all(c.passed for c in judge(SCENARIO, summary))
    summary = summarize(drained_node(), STREAMS, pods=PODS, facts=MARKED_ONCE)
    assert {c.name for c in judge(SCENARIO, summary) if not c.passed} == {"chats reasoning past the deadline are cut"}


def test_a_call_named_twice_is_not_the_message_and_the_expected_one_names_each_once() -> None:
    chats = Chats(reasoning_tokens=5)
    body = chats.body(slot=1, name="1", max_tokens=500)  # an odd slot: tools offered
    want = chats.expected(body)
    assert want.finish_reason == "tool_calls"
    assert want.roles == 1
    assert all("|" not in name and name for name, _ in want.calls)
    named = {"index": 0, "id": "a", "type": "function", "function": {"name": "get_time"}}
    twice = Assembly()
    for _ in range(2):
        twice.feed({"choices": [{"delta": {"tool_calls": [named]}, "finish_reason": None}]})
    assert twice.message().calls == (("get_time|get_time", ""),)
    assert assemble([b"data: [DONE]", b": comment", b"data: {not json"]).message() == Message()
