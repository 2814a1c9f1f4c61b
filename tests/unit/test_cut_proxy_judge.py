"""The judge of the real-engine gateway tests (tests/engines/cut_proxy.py): a dropped stream is excused only where the
engine's own tokens left the reference, and never where the gateway resumed from ids the engine had not sent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.engines.cut_proxy import Divergence, Recorded, diverged, own_tokens
from tests.engines.engine_record import RECORD_ENV, Message, Receive, Recorder, Send


def test_a_stream_diverged_only_where_a_leg_of_the_engine_is_no_run_of_the_reference_where_it_could_start() -> None:
    """The judge of tests/engines/test_gateway_vllm.py and test_gateway_reasoning.py, on the cases they meet."""
    reference = list(range(10, 20))
    assert diverged(reference, [reference[:4]]) is None  # the first leg, cut
    assert diverged(reference, [reference[:4], reference[4:]]) is None  # continued where it was cut
    assert diverged(reference, [reference[:4], reference[3:]]) is None  # the cut's last event lost: a token earlier
    assert diverged(reference, [reference[:4], reference[6:9], reference[8:]]) is None  # anywhere, and cut again
    assert diverged(reference, [reference[:4], []]) is None  # a continuation that sent no token yet
    assert diverged(reference, [reference]) is None
    assert diverged(reference, [reference[1:5]]) == Divergence(0, 0, 10, 11)  # a first leg starts at the start
    assert diverged(reference, [[10, 11, 99]]) == Divergence(0, 2, 12, 99)
    assert diverged(reference, [reference[:4], [13, 14, 99, 16]]) == Divergence(1, 5, 15, 99)
    assert diverged(reference, [reference[:4], [*reference[3:], 20]]) == Divergence(1, 10, None, 20)  # longer
    assert diverged(reference, [reference[:4], [99]]) == Divergence(1, 0, 10, 99)  # agreeing nowhere: the start


def test_a_continuation_is_the_engines_own_where_it_resumes_from_the_prompt_and_the_ids_the_engine_sent() -> None:
    """How those tests tell a wrong splice from the engine's divergence."""
    prompt = [1, 2]
    assert own_tokens(prompt, [(None, [5, 6, 7]), ([1, 2, 5, 6], [7, 8])]) == [5, 6, 7, 8]  # from the last event lost
    assert own_tokens(prompt, [(None, [5, 6]), ([1, 2, 5, 6], [9]), ([1, 2, 5, 6, 9], [8])]) == [5, 6, 9, 8]
    assert own_tokens(prompt, [(None, [5]), (None, [5, 6])]) == [5, 6]  # started over
    assert own_tokens(prompt, [(None, [5, 6]), ([1, 2, 5, 6, 7], [8])]) is None  # a token the engine never sent
    assert own_tokens(prompt, [(None, [5, 6]), ([1, 2, 6], [7])]) is None  # one left out
    assert own_tokens(prompt, [(None, [5, 6]), ([1, 5, 6], [7])]) is None  # the prompt's own


async def test_an_engine_records_each_post_and_each_piece_it_sends_and_the_reader_makes_them_legs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/engines/engine_record.py inside a server, read back as a proxy keeps legs: the first leg's prompt ids
    from its first chunk, a continuation's from the ids it was asked with; whatever the server is sent (a client's
    disconnect) reaches it unchanged, and what is not a POST is not recorded."""
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    heard: list[Message] = []

    async def engine(scope: Message, receive: Receive, send: Send) -> None:
        while (message := await receive())["type"] == "http.request" and message.get("more_body"):
            pass
        heard.append(message)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for ids in scope.get("sends", ()):
            await send({"type": "http.response.body", "body": _event(ids, scope.get("prompt_ids")), "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    def request(method: str, path: str, body: dict[str, Any], **scope: Any) -> tuple[Message, Receive, Send]:
        raw = json.dumps(body).encode()
        parts: list[Message] = [
            {"type": "http.request", "body": raw[:5], "more_body": True},
            {"type": "http.request", "body": raw[5:]},
        ]

        async def receive() -> Message:
            return parts.pop(0)

        async def send(message: Message) -> None:
            pass

        return {"type": "http", "method": method, "path": path, **scope}, receive, send

    recorder = Recorder(engine)
    await recorder(*request("POST", "/v1/chat/completions", {"user": "u1"}, prompt_ids=[1, 2], sends=[[5], [6, 7]]))
    await recorder(*request("POST", "/v1/completions", {"user": "u1", "prompt": [1, 2, 5, 6]}, sends=[[7], [8]]))
    await recorder(*request("GET", "/v1/models", {"user": "u2"}, sends=[[9]]))
    legs = Recorded.read(tmp_path).legs
    assert list(legs) == ["u1"]
    assert [(leg.asked, leg.prompt, leg.ids) for leg in legs["u1"]] == [
        (None, [1, 2], [5, 6, 7]),
        ([1, 2, 5, 6], [], [7, 8]),
    ]
    assert legs["u1"][0].started < legs["u1"][1].started
    assert [m["body"] for m in heard] == [b'r": "u1"}', b'r": "u1", "prompt": [1, 2, 5, 6]}', b'r": "u2"}']  # unchanged

    async def gone() -> Message:
        return {"type": "http.disconnect"}

    scope, _, send = request("POST", "/v1/completions", {"user": "u3"}, sends=[[4]])
    await recorder(scope, gone, send)
    assert heard[-1] == {"type": "http.disconnect"}
    assert list(Recorded.read(tmp_path).legs) == ["u1"]  # a request whose body never came is not one


def _event(ids: list[int], prompt: list[int] | None) -> bytes:
    chunk = {"prompt_token_ids": prompt, "choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": ids}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"
