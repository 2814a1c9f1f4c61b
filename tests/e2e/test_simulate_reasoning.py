"""``spotdrain simulate --scenario reasoning-streams --gateway``: chats that reason past the deadline, some calling
tools, continued on the second node by the real gateway and each assembling, in its client, to the uninterrupted
message. The same compressed time as tests/e2e/test_simulate.py (a 13 s notice, two pods, two streams each)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_simulate import NOTICE_S, play

pytestmark = pytest.mark.e2e


async def test_through_the_gateway_chats_reasoning_past_the_deadline_continue_to_their_uninterrupted_message(
    tmp_path: Path,
) -> None:
    result = await play("reasoning-streams", tmp_path, gateway=True)
    s = result.summary
    assert result.passed, [c for c in result.checks if not c.passed]
    assert s.cut == 0
    assert s.cut_reported > 0, "the drained pods still cut the chats reasoning past their deadline"
    assert s.continued >= s.cut_reported
    assert s.completed == s.started  # each one judged by its message: reasoning, content, calls, finish reason
    moved = [r for r in result.streams if r.moves]
    assert {r.slot % 2 for r in moved} == {0, 1}, "a chat without tools and one calling them were continued"
    assert all(r.ended - r.started > NOTICE_S for r in moved)
