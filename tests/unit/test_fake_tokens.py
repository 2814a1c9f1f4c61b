"""The fake engine's model: what makes a continuation yield exactly the tokens an uninterrupted run would have."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simulate.fakes.tokens import (
    SPLIT,
    VOCAB,
    WORD_PIECES,
    ChatError,
    Context,
    Detokenizer,
    render_chat,
    text_of,
    tokenize,
)

words = st.lists(st.integers(min_value=0, max_value=len(WORD_PIECES) - 1), max_size=30)
generated = st.lists(st.integers(min_value=0, max_value=len(VOCAB) - 1), max_size=40)


@given(st.text(), words)
def test_text_then_generated_words_tokenizes_as_the_text_then_those_ids(prefix: str, ids: list[int]) -> None:
    assert tokenize(prefix + text_of(ids)) == tokenize(prefix) + ids


def test_a_split_character_does_not_tokenize_back_into_its_halves() -> None:
    """As on a real tokenizer: the text of generated ids, tokenised again, is other ids."""
    halves = [len(WORD_PIECES), len(WORD_PIECES) + 1]
    assert text_of(halves) == " straße"
    assert tokenize(text_of(halves)) != halves


@given(generated)
def test_streamed_text_is_the_whole_decoded_text_with_partial_characters_held_back(ids: list[int]) -> None:
    detokenizer = Detokenizer()
    pieces = [detokenizer.step(token) for token in ids]
    assert "".join(pieces) + detokenizer.pending.decode(errors="replace") == text_of(ids)
    for token, piece in zip(ids, pieces, strict=True):
        if VOCAB[token] in SPLIT[::2]:  # a first half always ends inside a character
            assert piece == ""


def test_a_prompt_ending_inside_a_character_is_echoed_into_the_first_text_as_vllm_does() -> None:
    first_half, second_half = len(WORD_PIECES), len(WORD_PIECES) + 1
    assert Detokenizer([3, first_half]).step(second_half) == " delta straße"
    assert Detokenizer([3]).step(first_half) == ""
    assert Detokenizer([3, 4]).step(5) == " fjord"  # a prompt ending on a whole character: only the new text


@given(st.text(), st.integers(min_value=0, max_value=60))
def test_without_partial_characters_only_whole_words_are_generated(prompt: str, count: int) -> None:
    context = Context(tokenize(prompt), partial_utf8=False)
    for _ in range(count):
        token = context.next_token()
        assert token < len(WORD_PIECES)
        context.push(token)


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
    assert run(Context(tokenize(prompt) + head), then) == whole[first:]  # continued by ids
    words = run(Context(tokenize(prompt), partial_utf8=False), first + then)
    head = words[:first]
    assert run(Context(tokenize(prompt + text_of(head)), partial_utf8=False), then) == words[first:]  # by text


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
