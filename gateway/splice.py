"""One client stream out of the streams of one or more backends: pure bookkeeping, no I/O.

The splicer reads each backend event once and decides what the client gets: the first backend's chunks as they
came (bytes untouched, but for the token ids the gateway asked for itself, nulled), a continuation's chunks rewritten
to the first backend's ``id``, ``created`` and ``model`` (and to the chat's shape when a chat continues on
``/v1/completions``), one chat role delta, exactly one ``finish_reason``, and, at the end, one usage chunk and one
``data: [DONE]`` that the gateway writes itself; a chat the engine parses (reasoning, tool calls) that continues on
``/v1/completions`` gets its parsers' deltas there (gateway.parsed). It also keeps what a continuation needs: the
text so far, the token count, the token ids where the backend returned them (vLLM's ``return_token_ids``) and
whether a tool call has started.

Every id is a token, empty text or not: vLLM streams a token that ends inside a multi-byte character as a chunk with
empty text, and the character comes with a later token. A prompt that ends inside a character makes vLLM echo the
whole decoded prompt, so a continuation by ids starts where the ids are known to end a character: after the last
chunk of one token that brought text (vLLM's decoder streams text only when it ends a character). A chunk of several
tokens tells nothing about its last one: when its API server falls behind, vLLM merges the steps not yet sent into one
chunk (RequestOutputCollector in vllm/v1/engine/output_processor.py), and the last of them may start a character the
text leaves out. Greedy decoding generates the tokens after that point again; the client, which already had their
text and chunks, does not get them twice.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field
from typing import Any

from gateway.chunk_shape import Shape, hidden, learn
from gateway.ends import DONE, Broken, End, Finished, sse
from gateway.parsed import Replayed
from gateway.reshape import as_chat
from gateway.token_ids import hide, hide_in

try:  # the gateway extra: a chunk parsed in a fifth of json's time, the splicer's largest cost
    from orjson import loads as _fast_loads
except ImportError:  # installed without the gateway extra: json alone
    _fast_loads = json.loads  # type: ignore[assignment]

# A stream's shape is learned from one of its first chunks, or not at all: a stream whose first chunks all differ
# (logprobs, usage on each) is not parsed again to learn from every one.
LEARN_WITHIN_TOKENS = 32


@dataclass(slots=True)
class Step:
    out: bytes = b""  # for the client, possibly nothing
    end: End | None = None


@dataclass(slots=True)
class Splicer:
    chat: bool
    include_usage: bool
    hide_ids: bool = False  # the client did not ask for token ids: the gateway did, for itself
    top_logprobs: int = 0  # a chat's, for its chunks continued on /v1/completions
    identity: dict[str, Any] | None = None  # id, created, model of the first chunk ever
    segment: int = 0  # 0 for the first backend, then one per continuation
    source_chat: bool | None = None  # the current backend's shape (None: the client's)
    continuing: bool = False  # the current backend answers a continuation (else the client's own request)
    # Compact on purpose: a long stream holds its whole text and ids (UTF-8 bytes, 8-byte ids), not an object each.
    text: bytearray = field(default_factory=bytearray)
    tokens: int = 0
    token_ids: array[int] | None = field(default_factory=lambda: array("q"))  # None once a token came without its id
    prompt_token_ids: list[int] | None = None
    # Where a continuation by ids starts: ids known to end a character, and the bytes of text up to there.
    resume_ids: int = 0
    resume_text: int = 0
    shown: int = 0  # tokens the client has had a chunk for (more than ``tokens`` after a rewind)
    behind: int = 0  # bytes of text the client has that the current backend is still generating again
    role_sent: bool = False
    finish_reason: str | None = None
    tool_call: bool = False
    reasoning: bool = False
    multiple_choices: bool = False
    tokens_before_segment: int = 0
    backend_usage: dict[str, Any] | None = None
    raw_usage: bytes | None = None
    shapes: bool = True  # read the first backend's plain token chunks by their shape (False: parse every one)
    shape: Shape | None = None  # of the first backend's plain token chunks, once learned
    replayed: Replayed | None = None  # a parsed chat continued on /v1/completions: its text through the parsers

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text_so_far(self) -> str:
        return self.text.decode(errors="surrogatepass")

    @property
    def from_chat(self) -> bool:
        return self.chat if self.source_chat is None else self.source_chat

    def next_segment(self, *, source_chat: bool | None = None) -> None:
        """A continuation starts: what it reports about usage is relative to the tokens sent before it.

        ``source_chat``: its backend's shape (None: the client's)."""
        self.continuing = self.shown > 0  # else nothing generated reached the client: its request starts over
        self.segment += 1
        self.shape = None  # a continuation's chunks are rewritten: each is parsed
        self.source_chat = source_chat
        self.tokens_before_segment = self.tokens
        self.backend_usage = self.raw_usage = None
        self.replayed = None

    def rewind(self) -> None:
        """The continuation goes on by ids from ``resume_ids``: the tokens after it come again."""
        if self.token_ids is None:
            return
        del self.token_ids[self.resume_ids :]
        self.tokens = self.tokens_before_segment = self.resume_ids
        self.behind = len(self.text) - self.resume_text

    def accept(self, data: bytes) -> Step:
        """One backend event (the bytes after ``data:``): what to relay and whether this backend's stream ended."""
        if self.shape is not None and (out := self.by_shape(b"data: " + data + b"\n\n")) is not None:
            return Step(out=out)
        if data == b"[DONE]":
            if self.finished or self.multiple_choices:
                return Step(end=Finished())
            return Step(end=Broken("reset", "[DONE] before a finish_reason"))
        try:
            chunk = parse_json(data)
        except (ValueError, RecursionError):
            return Step(end=Broken("garbage", data[:80].decode(errors="replace")))
        if not isinstance(chunk, dict):
            return Step(end=Broken("garbage", "an event that is not a JSON object"))
        if "error" in chunk or chunk.get("object") == "error":
            error = chunk.get("error", chunk)
            message = error.get("message", "") if isinstance(error, dict) else str(error)
            return Step(end=Broken("error_event", str(message)[:200]))
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return Step(end=Broken("garbage", "a chunk without choices"))
        if self.identity is None:
            self.identity = {key: chunk.get(key) for key in ("id", "created", "model")}
        if not choices:
            return self._usage(chunk, data)
        if len(choices) != 1 or not isinstance(choices[0], dict) or choices[0].get("index", 0) != 0:
            self.multiple_choices = True  # n > 1: relayed as it comes, never continued
            return Step(out=self._relay(chunk, data))
        return self._choice(chunk, choices[0], data)

    def _usage(self, chunk: dict[str, Any], data: bytes) -> Step:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.backend_usage, self.raw_usage = usage, data
        return Step()

    def _choice(self, chunk: dict[str, Any], choice: dict[str, Any], data: bytes) -> Step:
        piece, dropped = self._piece(chunk, choice)
        if piece is None:
            return Step(end=Broken("garbage", "a choice without text"))
        if self.replayed is not None and not self.from_chat:
            return self._replayed(self.replayed, chunk, choice, piece)
        finish = choice.get("finish_reason")
        if self.prompt_token_ids is None and not self.continuing:
            self._note_prompt_ids(chunk, choice)
        new = self._new_text(piece)
        repeated = self._count(choice.get("token_ids"), piece)
        if new != piece:
            self._set_text(choice, new)
        if repeated:
            choice["token_ids"] = choice["token_ids"][repeated:]
            _drop_logprobs(choice, repeated)
        if finish in ("abort", "error"):  # vLLM aborted the request (shutdown) or failed it: continue elsewhere
            choice["finish_reason"] = None
            # Its token may have no text yet (an incomplete character): counted as shown, its id must reach the client
            carries = new or (isinstance(choice.get("token_ids"), list) and choice["token_ids"])
            out = self._relay(chunk, b"") if carries else b""
            return Step(out=out, end=Broken("abort" if finish == "abort" else "error_event", f"finish_reason {finish}"))
        if finish is not None:
            self.finish_reason = str(finish)
        if dropped or (repeated and not new and finish is None and not choice["token_ids"]):
            return Step()  # the client had this chunk already
        if self.shapes and self.shape is None and not self.segment and self.tokens <= LEARN_WITHIN_TOKENS:
            self.shape = learn(data, choice, chat=self.chat)
        return Step(out=self._relay(chunk, data))

    def _replayed(self, replayed: Replayed, chunk: dict[str, Any], choice: dict[str, Any], piece: str) -> Step:
        """A parsed chat's continuation chunk, with the delta and finish its parsers would have given its text."""
        finish = choice.get("finish_reason")
        aborted = finish in ("abort", "error")
        if aborted:
            choice["finish_reason"] = None
        elif finish is not None:
            self.finish_reason = str(finish)
        chat = as_chat(chunk, top_logprobs=self.top_logprobs)
        repeated = self._count(chat["choices"][0].get("token_ids"), piece)
        keep = replayed.chunk(chat["choices"][0], repeated=repeated, with_ids=not self.hide_ids)
        relayed = self._rewritten(chat) if keep else b""
        if aborted:
            return Step(
                out=relayed, end=Broken("abort" if finish == "abort" else "error_event", f"finish_reason {finish}")
            )
        return Step(out=relayed)

    def by_shape(self, event: bytes) -> bytes | None:
        """What to relay of ``event`` (``data:`` line and blank line), a plain token chunk of the first backend, read
        from its bytes by the stream's shape, and what the parse (``_choice``) would have kept of it; None where the
        event needs ``accept``."""
        shape = self.shape
        slots = None if shape is None else shape.match(event)
        if slots is None:
            return None
        text, token, ids_at = slots
        self.text += text  # the first backend's: nothing of it is behind
        if token is not None:
            tokens = self.tokens = self.shown = self.tokens + 1  # the first backend's: the client has every token
            if (ids := self.token_ids) is not None:
                ids.append(token)
            if text:
                self.resume_ids, self.resume_text = tokens, len(self.text)
            if self.hide_ids:
                assert shape is not None
                return hidden(shape, event, ids_at)
        elif text:
            self.tokens = self.shown = self.tokens + 1
            self.token_ids = None
        return event

    def _new_text(self, piece: str) -> str:
        """What of ``piece`` the client does not have yet (after a rewind, the backend first says it again)."""
        encoded = piece.encode(errors="surrogatepass")  # JSON may carry lone surrogates
        if not self.behind:
            self.text += encoded
            return piece
        skip = min(self.behind, len(encoded))
        self.behind -= skip
        for at, char in enumerate(piece):
            if skip <= 0:
                new = piece[at:]
                break
            skip -= len(char.encode(errors="surrogatepass"))
        else:
            new = ""
        self.text += new.encode(errors="surrogatepass")
        return new

    def _set_text(self, choice: dict[str, Any], text: str) -> None:
        if self.from_chat:
            choice["delta"]["content"] = text
        else:
            choice["text"] = text

    def _count(self, ids: Any, piece: str) -> int:
        """Count the chunk's tokens; how many of its first ids the client already had a chunk for."""
        if not isinstance(ids, list):  # one token per chunk with text: the best guess without ids
            if piece:
                self.tokens += 1
                self.token_ids = None
            self.shown = max(self.shown, self.tokens)
            return 0
        start = self.tokens
        self.tokens += len(ids)
        if self.token_ids is not None:
            known = len(self.token_ids)
            try:
                self.token_ids.extend(ids)
            except (TypeError, OverflowError):  # what is no 8-byte id is left out
                del self.token_ids[known:]
                self.token_ids.extend(i for i in ids if isinstance(i, int) and -(2**63) <= i < 2**63)
        if piece and len(ids) == 1:
            self.resume_ids, self.resume_text = self.tokens, len(self.text) - self.behind
        repeated = min(len(ids), max(0, self.shown - start))
        self.shown = max(self.shown, self.tokens)
        return repeated

    def _piece(self, chunk: dict[str, Any], choice: dict[str, Any]) -> tuple[str | None, bool]:
        """The choice's new text, and whether the chunk is a repeated role delta the client must not see."""
        if not self.from_chat:
            text = choice.get("text")
            return (text if isinstance(text, str) else None), False
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return None, False
        if delta.get("tool_calls"):
            self.tool_call = True
        if delta.get("reasoning_content") or delta.get("reasoning"):
            self.reasoning = True
        content = delta.get("content") or ""
        if not isinstance(content, str):
            return None, False
        if "role" in delta:
            if not self.role_sent:
                self.role_sent = True
            elif content or delta.get("tool_calls") or choice.get("finish_reason"):
                del delta["role"]
                chunk.pop("prompt_token_ids", None)
            else:
                return content, True
        return content, False

    def _note_prompt_ids(self, chunk: dict[str, Any], choice: dict[str, Any]) -> None:
        ids = choice.get("prompt_token_ids", chunk.get("prompt_token_ids"))
        if isinstance(ids, list):
            self.prompt_token_ids = [i for i in ids if isinstance(i, int)]

    def _relay(self, chunk: dict[str, Any], data: bytes) -> bytes:
        if self.segment == 0 and data:
            return b"data: " + (hide(data) if self.hide_ids else data) + b"\n\n"
        assert self.identity is not None
        if self.chat and not self.from_chat:
            chunk = as_chat(chunk, top_logprobs=self.top_logprobs)
        return self._rewritten(chunk)

    def _rewritten(self, chunk: dict[str, Any]) -> bytes:
        """A continuation's chunk, in the client's shape already, as the first backend's stream."""
        assert self.identity is not None
        chunk.update(self.identity)
        usage = chunk.get("usage")
        if isinstance(usage, dict) and self.tokens_before_segment:  # continuous_usage_stats, relative to this backend
            chunk["usage"] = self._whole_usage(usage)
        if self.continuing:  # its prompt is not the client's
            if "prompt_token_ids" in chunk:
                chunk["prompt_token_ids"] = None
            for choice in chunk.get("choices", ()):
                if isinstance(choice, dict) and choice.get("prompt_token_ids") is not None:
                    choice["prompt_token_ids"] = None
        if self.hide_ids:
            hide_in(chunk)
        return sse(chunk)

    def finish_chunk(self, reason: str) -> bytes:
        """A last chunk the gateway writes itself, when every token was sent but the finish never came."""
        assert self.identity is not None
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": reason}
        if self.chat:
            choice["delta"] = {}
        else:
            choice.update(text="", stop_reason=None)
        self.finish_reason = reason
        return sse({**self.identity, "object": self._object, "choices": [choice]})

    @property
    def _object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def tail(self) -> bytes:
        """What ends the client's stream: the usage chunk (when asked for) and ``[DONE]``."""
        if not self.include_usage or self.identity is None:
            return DONE
        if self.segment == 0 and self.raw_usage is not None:
            return b"data: " + self.raw_usage + b"\n\n" + DONE
        return sse({**self.identity, "object": self._object, "choices": [], "usage": self.usage()}) + DONE

    def usage(self) -> dict[str, Any]:
        """``prompt_tokens`` of the original request; ``completion_tokens`` for every token the client received."""
        usage = self._whole_usage(self.backend_usage or {})
        return usage if self.replayed is None else self.replayed.usage(usage)

    def _whole_usage(self, reported: dict[str, Any]) -> dict[str, int]:
        """A continuation's usage as the client's whole stream: its prompt held the original prompt plus the tokens
        sent before it, so the original's prompt size is the continuation's less those (exact where the backend
        returned prompt token ids)."""
        final_completion = reported.get("completion_tokens")
        completion = self.tokens
        if isinstance(final_completion, int):
            completion = self.tokens_before_segment + final_completion
        prompt = len(self.prompt_token_ids) if self.prompt_token_ids is not None else None
        if prompt is None and isinstance(reported.get("prompt_tokens"), int):
            prompt = max(0, int(reported["prompt_tokens"]) - self.tokens_before_segment)
        prompt = prompt or 0
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


def parse_json(data: bytes) -> Any:
    """orjson where it takes the bytes; else json, which also reads what orjson refuses: lone surrogates, NaN,
    integers past 64 bits, UTF-16 and UTF-32."""
    try:
        return _fast_loads(data)
    except ValueError:
        return json.loads(data)


def _drop_logprobs(choice: dict[str, Any], count: int) -> None:
    """A completions choice's logprobs without the first ``count`` tokens' (the client had them)."""
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        for key, value in logprobs.items():
            if isinstance(value, list):
                logprobs[key] = value[count:]
