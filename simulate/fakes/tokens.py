"""The fake engine's language model: a tokenizer, a chat template and a next token that depends only on the context.

Determinism by context is what lets the gateway's tests compare a spliced stream with an uninterrupted one: a
continuation sent as prompt + token ids so far holds the same context, so it yields the same next tokens. Greedy
decoding on a real engine behaves the same way.

Tokens are byte strings, as a byte-level BPE's are. Most are a space and a word; a few hold part of a multi-byte
character, so a token's text can be an incomplete UTF-8 character that only a later token completes, as on a real
tokenizer. With those left out (``partial_utf8=False``) the tokenizer is concatenation-stable for what the engine
generates, ``tokenize(a + generated) == tokenize(a) + generated_ids`` for any text ``a``, which is what continuing by
text needs; with them, re-tokenising the text so far gives other ids, as it does on a real tokenizer.
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
# Multi-byte characters split across two tokens, each first half ending inside a character: " straße", " naïve",
# " узел", " 流れ", " 🚀". Generated in any order, a first half not followed by its second gives U+FFFD, as the
# tiny Llama's byte-level tokens do on vLLM 0.32.0 (measured: "�prompt", "��Ελλάδα").
SPLIT = (
    b" stra\xc3", b"\x9fe", b" na\xc3", b"\xafve", b" \xd1\x83\xd0", b"\xb7\xd0\xb5\xd0\xbb", b" \xe6\xb5",
    b"\x81\xe3\x82\x8c", b" \xf0\x9f", b"\x9a\x80",
)
# fmt: on
WORD_PIECES = tuple(f" {word}".encode() for word in WORDS)
VOCAB = WORD_PIECES + SPLIT  # ids 0 .. len(VOCAB) - 1: the only tokens the engine generates
_IDS = {piece.decode(): index for index, piece in enumerate(WORD_PIECES)}
# Prompt pieces outside the vocabulary get ids above it, from a hash, so any text has a stable id sequence.
_PROMPT_ID_SPACE = 1 << 20
_PIECE = re.compile(r" ?[^\s]+|\s")
_MASK = (1 << 64) - 1
_HELD = "\ufffd"


# The thinking template's tokens (simulate/fakes/thinking.py), one id each, above every prompt piece's id: ChatML's
# turns, the reasoning and Hermes' tool-call markers, and the tool signatures' block. As on Hermes 2 Pro's tokenizer,
# the turns and the tool-call markers are special (left out of the text under ``skip_special_tokens``, which is why
# vllm/tool_parsers/hermes_tool_parser.py ``adjust_request`` turns it off); ``<think>`` and ``</think>`` are not, as
# on DeepSeek-R1's and Qwen3's (and simulate/vllm/transcripts.py's thinking model).
MARKERS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tools>", "</tools>")
MARKER_BASE = len(VOCAB) + _PROMPT_ID_SPACE
MARKER_IDS = {text: MARKER_BASE + index for index, text in enumerate(MARKERS)}
SPECIAL_IDS = frozenset(MARKER_IDS[m] for m in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"))
# One token per byte, as a byte-level BPE's base alphabet: the tool calls' JSON is generated in them, and the tool
# signatures in the prompt are read in them, so the model can read them back from the prompt's ids.
BYTE_BASE = MARKER_BASE + 64
_MARKER = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")


def token_id(piece: str) -> int:
    known = _IDS.get(piece)
    if known is not None:
        return known
    return len(VOCAB) + zlib.crc32(piece.encode()) % _PROMPT_ID_SPACE


def byte_ids(text: str) -> list[int]:
    return [BYTE_BASE + b for b in text.encode()]


def tokenize(text: str) -> list[int]:
    """Pieces are an optional space and a run of non-space characters, or one whitespace character; a marker is one
    token, and what ``<tools>`` and ``</tools>`` enclose is bytes."""
    ids: list[int] = []
    in_tools = False
    for part in _MARKER.split(text):
        if part in MARKER_IDS:
            ids.append(MARKER_IDS[part])
            in_tools = part == "<tools>"
        elif in_tools:
            ids += byte_ids(part)
        else:
            ids += [token_id(piece) for piece in _PIECE.findall(part)]
    return ids


def _bytes(token: int, *, skip_special: bool) -> bytes:
    if 0 <= token < len(VOCAB):
        return VOCAB[token]
    if BYTE_BASE <= token < BYTE_BASE + 256:
        return bytes([token - BYTE_BASE])
    if MARKER_BASE <= token < MARKER_BASE + len(MARKERS) and not (skip_special and token in SPECIAL_IDS):
        return MARKERS[token - MARKER_BASE].encode()
    return b""


def bytes_of(ids: Iterable[int], *, skip_special: bool = False) -> bytes:
    """The bytes of generated ids (prompt ids outside the vocabulary have none and are skipped)."""
    return b"".join(_bytes(i, skip_special=skip_special) for i in ids)


def text_of(ids: Iterable[int], *, skip_special: bool = False) -> str:
    """The text of generated ids, decoded as a whole (bytes that make no character become U+FFFD)."""
    return bytes_of(ids, skip_special=skip_special).decode(errors="replace")


class Detokenizer:
    """The text each generated token adds, as vLLM streams it.

    vLLM decodes incrementally (tokenizers' ``DecodeStream``, in vllm/v1/engine/detokenizer.py): while the decoded
    bytes end in U+FFFD (an incomplete character) a token adds no text, and the next token that ends cleanly brings
    all of it. It primes that decoder with the prompt, and a prompt that itself ends inside a character leaves it
    nothing to stand on: the first text it streams is the whole decoded prompt and the new text (vLLM 0.32.0,
    measured: prompt ids ending after an empty-text token, first chunk "the node drains*stream\ufffdprompt").
    """

    def __init__(self, prompt_ids: Iterable[int] = (), *, skip_special: bool = True) -> None:
        self.skip_special = skip_special
        prompt = bytes_of(prompt_ids, skip_special=skip_special)
        self.pending = prompt if prompt.decode(errors="replace").endswith(_HELD) else b""

    def step(self, token: int) -> str:
        self.pending += bytes_of([token], skip_special=self.skip_special)
        text = self.pending.decode(errors="replace")
        if text.endswith(_HELD):
            return ""
        self.pending = b""
        return text


class Context:
    """A rolling hash over every token so far; the next token is a function of it alone."""

    def __init__(self, ids: Iterable[int] = (), *, partial_utf8: bool = True) -> None:
        self.vocab = len(VOCAB) if partial_utf8 else len(WORD_PIECES)
        self.state = 0x9E3779B97F4A7C15
        self.length = 0
        for i in ids:
            self.push(i)

    def push(self, token: int) -> None:
        self.state = ((self.state ^ (token + 1)) * 0x100000001B3) & _MASK
        self.length += 1

    def next_token(self) -> int:
        mixed = (self.state ^ (self.state >> 29)) * 0xBF58476D1CE4E5B9 & _MASK
        return (mixed ^ (mixed >> 32)) % self.vocab


class ChatError(ValueError):
    """A chat request the template cannot render (vLLM answers these with a 400)."""


def message_text(message: Mapping[str, Any]) -> str:
    """A chat message's text, as a template renders it."""
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
        parts.append(f"<|{message['role']}|>\n{message_text(message)}{end}")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)
