"""What the thinking model says: fixed chats (prompt, tools) and the exact completion it is trained to give each.

Plain data, imported both by the recipe (``thinking_model.py``, run with the vLLM venv's Python, where this module
sits beside it on ``sys.path``) and by the tests, which check that real vLLM, decoding greedily, gives these
completions. The texts are generated here from fixed seeds, so they change only when this file does.

The chat template is ChatML, as Qwen's and Hermes' are: tools go into a system turn inside ``<tools></tools>`` (each
as the JSON of its function's name, description and parameters: vLLM hands the template ``tool.model_dump()``,
whose ``null`` fields would otherwise be rendered too), and the assistant's turn opens with ``<think>\\n``, as
DeepSeek-R1's and Qwen3-thinking's templates do, so the model writes its reasoning first and closes it with
``</think>``. A tool call is Hermes' ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"
# Added to the vocabulary as single tokens that are not special: the detokenizer keeps them in the text, where
# vLLM's parsers look for them (DeepSeek-R1's and Qwen3's tokenizers mark ``<think>`` the same way).
MARKERS = (THINK_START, THINK_END, TOOL_START, TOOL_END)
END_OF_TURN = "<|im_end|>"  # the end-of-sequence token: generation stops on it
SPECIAL = ("<|endoftext|>", "<|im_start|>", END_OF_TURN)

_TOOLS_PREAMBLE = (
    "<|im_start|>system\nYou may call functions. Signatures are within <tools></tools>:\n<tools>"
    "{% for tool in tools %}\n{{ {'name': tool['function']['name'], 'description': tool['function']['description'],"
    " 'parameters': tool['function']['parameters']} | tojson }}{% endfor %}\n</tools>\n"
    'Return each call as <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n'
)
CHAT_TEMPLATE = (
    "{% if tools %}" + _TOOLS_PREAMBLE + "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a zone",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
        },
    },
]

_TEXT = (
    "the a node drains stream token replica gateway pod notice deadline cache model request reply prompt chunk "
    "first then so because while before after it its each one two three four five six seven eight nine ten "
    "spot capacity engine queue server client weather city time zone check call look answer think know see "
    "may must will can not all some more less long short fast slow open close end start keep move send read "
    "café naïve über"  # multi-byte characters: some tokens are partial UTF-8, which vLLM streams as empty text
)
_WORDS = _TEXT.split()


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, str]

    def text(self) -> str:
        return f"{TOOL_START}\n{json.dumps({'name': self.name, 'arguments': self.arguments})}\n{TOOL_END}"


@dataclass(frozen=True)
class Transcript:
    """One chat: the user's words, whether tools are offered, and the completion the model gives."""

    name: str
    user: str
    reasoning: str  # the text between the template's ``<think>\n`` and ``</think>``
    content: str  # after ``</think>`` (and before any tool call)
    calls: tuple[Call, ...] = ()

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.user}]

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        return TOOLS if self.calls else None

    @property
    def completion(self) -> str:
        """The generated text as the detokenizer gives it (the end-of-turn token is special: not in it)."""
        calls = "\n".join(call.text() for call in self.calls)
        return f"{self.reasoning}{THINK_END}{self.content}{calls}"


def _sentences(rng: random.Random, words: int) -> str:
    out: list[str] = []
    while len(out) < words:
        sentence = [rng.choice(_WORDS) for _ in range(rng.randint(6, 14))]
        out += [sentence[0].capitalize(), *sentence[1:-1], sentence[-1] + "."]
    return " ".join(out)


def _transcript(
    seed: int, name: str, user: str, thinking: int, answer: int, calls: tuple[Call, ...] = ()
) -> Transcript:
    rng = random.Random(seed)
    body = _sentences(rng, answer) if answer else ""
    content = "\n\n" + body + ("\n" if calls and body else "")
    return Transcript(name, user, _sentences(rng, thinking) + "\n", content, calls)


TRANSCRIPTS = (
    _transcript(11, "drain", "Why does the node drain first?", 220, 30),
    _transcript(12, "stream", "How long may one stream run?", 260, 24),
    _transcript(13, "replica", "Which replica takes a stream that broke?", 180, 36),
    _transcript(21, "weather", "What is the weather in Paris?", 90, 8, (Call("get_weather", {"city": "Paris"}),)),
    _transcript(
        22,
        "two_calls",
        "Weather in Oslo and the time in Tokyo?",
        110,
        10,
        (Call("get_weather", {"city": "Oslo", "unit": "celsius"}), Call("get_time", {"zone": "Asia/Tokyo"})),
    ),
    _transcript(23, "call_only", "Time in Lima, please.", 70, 0, (Call("get_time", {"zone": "America/Lima"}),)),
)


def by_name(name: str) -> Transcript:
    return next(t for t in TRANSCRIPTS if t.name == name)
