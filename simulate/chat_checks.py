"""The reasoning-streams scenario's verdict: chats that reason for longer than the notice, some calling tools.

Without the gateway they are what long streams are: cut at the deadline, and counted. Through it each one the
drained pods could not finish is continued on the other node, and still assembles, in the client, to the message of
its uninterrupted stream (the load records a chat that does not as cut: simulate/load.py).
"""

from __future__ import annotations

from simulate.check import Check, all_gone, check
from simulate.summary import Summary


def reasoning_streams(s: Summary) -> list[Check]:
    return [
        check("chats reasoning past the deadline are cut", s.cut > 0, f"{s.cut} cut"),
        check("short chats still complete", s.completed > 0, f"{s.completed} completed intact"),
        all_gone(s),
    ]


def reasoning_through_gateway(s: Summary) -> list[Check]:
    """Added to the gateway's own checks (none cut, every cut the sidecars saw continued)."""
    return [
        check("chats that outlived the notice were continued", s.continued > 0, f"{s.continued} continuations"),
        check(
            "every chat assembled to its uninterrupted message",
            s.completed == s.started,
            f"{s.completed} of {s.started} (reasoning, content, each call's name and arguments, finish reason)",
        ),
    ]
