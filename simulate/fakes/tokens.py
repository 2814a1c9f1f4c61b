"""The fake engine's language model: a tokenizer, a chat template and a next token that depends only on the context.

Determinism by context is what lets the gateway's tests compare a spliced stream with an uninterrupted one: a
continuation sent as prompt + text so far (or as token ids) holds the same context, so it yields the same next tokens.
Greedy decoding on a real engine behaves the same way, up to the re-tokenisation of the text so far.

The tokenizer is concatenation-stable for what the engine generates: every generated token is a space and a word, so
``tokenize(a + generated) == tokenize(a) + generated_ids`` for any text ``a``.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# fmt: off
WORDS = (
    "amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel",
    "lagoon", "meadow", "nectar", "obsidian", "pebble", "quartz", "raven", "sierra", "tundra", "umber", "violet",
    "willow", "xenon", "yarrow", "zephyr", "atlas", "beacon", "canyon", "dune", "estuary", "falcon", "glacier",
    "heron", "island", "jasper", "kelp", "lantern", "mesa", "nimbus", "orchid", "prairie", "quill", "reef", "summit",
    "tide", "upland", "vale", "wren", "yonder", "zenith",
)
# fmt: on
VOCAB = tuple(f" {word}" for word in WORDS)  # ids 0 .. len(VOCAB) - 1: the only tokens the engine generates
_IDS = {text: index for index, text in enumerate(VOCAB)}
# Prompt pieces outside the vocabulary get ids above it, from a hash, so any text has a stable id sequence.
_PROMPT_ID_SPACE = 1 << 20
_PIECE = re.compile(r" ?[^\s]+|\s")
_MASK = (1 << 64) - 1


def token_id(piece: str) -> int:
    known = _IDS.get(piece)
    if known is not None:
        return known
    return len(VOCAB) + zlib.crc32(piece.encode()) % _PROMPT_ID_SPACE


def tokenize(text: str) -> list[int]:
    """Pieces are an optional space and a run of non-space characters, or one whitespace character."""
    return [token_id(piece) for piece in _PIECE.findall(text)]


def text_of(ids: Iterable[int]) -> str:
    """The text of generated ids (prompt ids outside the vocabulary have no text and are skipped)."""
    return "".join(VOCAB[i] for i in ids if 0 <= i < len(VOCAB))


class Context:
    """A rolling hash over every token so far; the next token is a function of it alone."""

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self.state = 0x9E3779B97F4A7C15
        self.length = 0
        for i in ids:
            self.push(i)

    def push(self, token: int) -> None:
        self.state = ((self.state ^ (token + 1)) * 0x100000001B3) & _MASK
        self.length += 1

    def next_token(self) -> int:
        mixed = (self.state ^ (self.state >> 29)) * 0xBF58476D1CE4E5B9 & _MASK
        return (mixed ^ (mixed >> 32)) % len(VOCAB)


class ChatError(ValueError):
    """A chat request the template cannot render (vLLM answers these with a 400)."""


def _content(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts carry text here
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    raise ChatError("message content must be a string or a list of parts")


def render_chat(
    messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool, continue_final_message: bool
) -> str:
    """A chat template in the shape of Hugging Face's ``apply_chat_template``.

    ``continue_final_message`` leaves the last message open (no end-of-turn), so generation continues its text;
    vLLM refuses it together with ``add_generation_prompt`` (vllm/entrypoints/openai/chat_completion/protocol.py,
    ``check_generation_prompt``), and so does this template.
    """
    if continue_final_message and add_generation_prompt:
        raise ChatError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    if not messages:
        raise ChatError("messages must not be empty")
    parts = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatError("every message needs a role")
        last = index == len(messages) - 1
        end = "" if last and continue_final_message else "<|end|>\n"
        parts.append(f"<|{message['role']}|>\n{_content(message)}{end}")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)
