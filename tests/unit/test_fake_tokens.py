"""The fake engine's model: what makes a continuation yield exactly the tokens an uninterrupted run would have."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulate.fakes.tokens import VOCAB, ChatError, Context, render_chat, text_of, tokenize

generated = st.lists(st.integers(min_value=0, max_value=len(VOCAB) - 1), max_size=30)


@given(st.text(), generated)
def test_text_then_generated_tokens_tokenizes_as_the_text_then_those_ids(prefix: str, ids: list[int]) -> None:
    assert tokenize(prefix + text_of(ids)) == tokenize(prefix) + ids


@given(st.text(), st.integers(min_value=1, max_value=40), st.integers(min_value=0, max_value=40))
def test_the_next_token_depends_only_on_the_context(prompt: str, first: int, then: int) -> None:
    def run(context: Context, count: int) -> list[int]:
        out = []
        for _ in range(count):
            token = context.next_token()
            context.push(token)
            out.append(token)
        return out

    whole = run(Context(tokenize(prompt)), first + then)
    head = run(Context(tokenize(prompt)), first)
    assert run(Context(tokenize(prompt + text_of(head))), then) == whole[first:]


def test_different_contexts_mostly_give_different_text() -> None:
    texts = set()
    for prompt in ("hello", "hello there", "a b c", "x"):
        context = Context(tokenize(prompt))
        ids = []
        for _ in range(8):
            ids.append(context.next_token())
            context.push(ids[-1])
        texts.add(text_of(ids))
    assert len(texts) == 4


def test_a_continued_assistant_message_renders_as_the_generation_prompt_plus_its_text() -> None:
    messages = [{"role": "user", "content": "hi"}]
    opened = render_chat(messages, add_generation_prompt=True, continue_final_message=False)
    reply = [*messages, {"role": "assistant", "content": " amber"}]
    continued = render_chat(reply, add_generation_prompt=False, continue_final_message=True)
    assert continued == opened + " amber"
    closed = render_chat(reply, add_generation_prompt=False, continue_final_message=False)
    assert closed.endswith("<|end|>\n")


def test_the_template_refuses_both_generation_prompt_and_continuation_as_vllm_does() -> None:
    with pytest.raises(ChatError, match="continue_final_message"):
        render_chat([{"role": "user", "content": "x"}], add_generation_prompt=True, continue_final_message=True)
