"""The judge of the real-engine gateway tests (tests/engines/cut_proxy.py): a dropped stream is excused only where the
engine's own tokens left the reference, and never where the gateway resumed from ids the engine had not sent."""

from __future__ import annotations

from tests.engines.cut_proxy import Divergence, diverged, own_tokens


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
