"""The scenarios ``spotdrain simulate`` plays, each with the load it runs and what its verdict demands.

Every expectation is a pure function of the run's ``Summary``; a scenario passes when all of its checks do.
"""

from __future__ import annotations

import enum
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from simulate.chat_checks import reasoning_streams, reasoning_through_gateway
from simulate.check import Check as Check  # where the report and the runs take it
from simulate.check import all_gone
from simulate.check import check as _check
from simulate.summary import ColdStart, PodSummary, Summary


class Profile(enum.Enum):
    SHORT = "short"  # every stream fits well inside the drain window
    MIXED = "mixed"  # every other slot opens streams far longer than the deadline


Checks = Callable[[Summary], list[Check]]


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    expectation: str  # what the verdict demands, in a sentence
    profile: Profile
    max_unavailable: int  # the PodDisruptionBudget's
    checks: Checks
    restart_agent: bool = False
    via_sqs: bool = False
    always_allow: bool = True  # the budget says unhealthyPodEvictionPolicy: AlwaysAllow, as deploy/ ships it
    pods: int | None = None  # the scenario's own number of pods, whatever --pods says
    lose_node: bool = False  # no notice: every process on the node is killed at once
    # How each pod's engine ends the streams still open at its SIGTERM, pod by pod in turn (the fake engine's
    # --sigterm-ending: vLLM's abort, error or hang); empty: the fake's default.
    sigterm_endings: tuple[str, ...] = ()
    cold_start: bool = False  # a replacement node joins, hydrates its model from S3 and serves a first token
    # The streams are chats of a thinking model served with vLLM's parsers (simulate/chats.py), judged by the message
    # they assemble to; with the gateway, ``gateway_checks`` are added to its own.
    chats: bool = False
    gateway_checks: Checks | None = None

    def sigterm_ending(self, pod: int) -> str | None:
        return self.sigterm_endings[pod % len(self.sigterm_endings)] if self.sigterm_endings else None


def stream_seconds(
    profile: Profile, *, slot: int, pods: int, rng: random.Random, window_s: float, notice_s: float
) -> float:
    """How long a stream opened by ``slot`` lasts; ``window_s`` is how long a drain may last after the notice.

    The router spreads the slots' first streams over the pods in turn, so long streams go to every other round of
    ``pods`` slots: each pod gets its share of both kinds.
    """
    if profile is Profile.MIXED and (slot // pods) % 2 == 0:
        return rng.uniform(1.5, 2.0) * notice_s
    top = 0.3 if profile is Profile.MIXED else 0.4
    return rng.uniform(0.1, top) * window_s


def _common(s: Summary) -> list[Check]:
    out = [p.name for p in s.pods if p.out_at is None]
    return [
        _check("every pod left rotation", not out, f"still in rotation: {', '.join(out)}" if out else "all did"),
        _check(
            "cut streams reported = cut streams seen",
            s.cut_reported == s.cut,
            f"sidecars reported {s.cut_reported}, the clients saw {s.cut}",
        ),
    ]


def _none_cut(s: Summary) -> Check:
    return _check("no stream cut", s.cut == 0, f"{s.cut} of {s.started} cut")


def _short_streams(s: Summary) -> list[Check]:
    late = [p.name for p in s.pods if p.out_before_eviction is False]
    evicted = sum(p.evicted_at is not None for p in s.pods)
    early = s.spare_s is not None and s.spare_s > 0
    return [
        _none_cut(s),
        _check("out of rotation before eviction", not late, f"late: {', '.join(late)}" if late else "every pod"),
        _check("every pod evicted", evicted == len(s.pods), f"{evicted} of {len(s.pods)}"),
        _check("node empty before the deadline", early, "no" if s.spare_s is None else f"{s.spare_s:.1f} s to spare"),
    ]


def _long_streams(s: Summary) -> list[Check]:
    return [
        _check("long streams are cut at the deadline", s.cut > 0, f"{s.cut} cut"),
        _check("short streams still complete", s.completed > 0, f"{s.completed} completed intact"),
        all_gone(s),
    ]


def _shipped_budget(s: Summary) -> list[Check]:
    ready = [p.name for p in s.pods if p.ready_when_evicted is not False]
    evicted = sum(p.evicted_at is not None for p in s.pods)
    return [
        _check(
            "every pod unready when evicted",
            not ready,
            f"Ready (or never evicted): {', '.join(ready)}" if ready else "the budget counted each one unhealthy",
        ),
        _check("AlwaysAllow evicts them all", evicted == len(s.pods), f"{evicted} of {len(s.pods)} evicted"),
        _none_cut(s),
        _check("node empty before the deadline", s.spare_s is not None and s.spare_s > 0, _spare(s)),
    ]


def _spare(s: Summary) -> str:
    return "no" if s.spare_s is None else f"{s.spare_s:.1f} s to spare"


def _pdb_blocks(s: Summary) -> list[Check]:
    return [
        _check("429s from the budget retried", s.eviction_refusals > 0, f"{s.eviction_refusals} refusals"),
        _check(
            "blocked evictions reported",
            s.evictions_given_up == len(s.pods) and s.evictions == 0,
            f"{s.evictions_given_up} given up, {s.evictions} evicted",
        ),
        _check("pods lost with the instance at the deadline", s.reclaimed == len(s.pods), f"{s.reclaimed} reclaimed"),
        _none_cut(s),
    ]


def _agent_restart(s: Summary) -> list[Check]:
    return [
        _check("agent restarted mid-drain", s.agent_restarts == 1, f"{s.agent_restarts} restarts"),
        _check("node marked once", s.node_patches == 1 and s.node_events == 1, _marks(s)),
        _check(
            "restart found the node marked",
            s.already_marked,
            "logged node.already_marked" if s.already_marked else "no",
        ),
        _none_cut(s),
        all_gone(s),
    ]


def _marks(s: Summary) -> str:
    return f"{s.node_patches} node patches, {s.node_events} Events"


def _sqs(s: Summary) -> list[Check]:
    drained = s.cordoned_at is not None and s.node_drained_at is not None
    return [
        _check("message deleted", s.message_deleted is True, f"queue empty: {s.message_deleted}"),
        _check("node cordoned and drained", drained, "yes" if drained else "no"),
        all_gone(s),
        _none_cut(s),
    ]


def _node_lost(s: Summary) -> list[Check]:
    return [
        _check("the streams on the lost node are cut and counted", s.cut > 0, f"{s.cut} of {s.started} cut"),
        _check("the node's pods are lost with it", s.reclaimed == len(s.pods), f"{s.reclaimed} lost"),
    ]


ENDINGS = ("abort", "error", "hang")


def _ending_check(pod: PodSummary, ending: str) -> Check:
    name = f"{pod.name} ({ending}): its open streams cut and counted"
    if pod.cut == 0:
        return _check(name, False, "no stream was open at the engine's SIGTERM")
    if ending == "hang":
        # The engine waits for clients that wait for it: only the kill at the end of the grace period ends both.
        killed = pod.cut_by_engine is None and pod.gone_at is not None
        detail = f"{pod.cut} cut; the engine never exited on its own and was killed" if killed else "not killed"
        return _check(name, killed, detail)
    took = None if pod.exited_at is None or pod.drained_at is None else pod.exited_at - pod.drained_at
    on_its_own = pod.cut_by_engine is not None and took is not None and took < 2.0
    detail = f"{pod.cut} cut, the engine counted {pod.cut_by_engine}"
    detail += f" and exited {took:.1f} s after the drain ended" if took is not None else " and never exited"
    return _check(name, on_its_own, detail)


def _sigterm_endings(s: Summary, *, endings: tuple[str, ...]) -> list[Check]:
    return [
        *(_ending_check(pod, endings[index % len(endings)]) for index, pod in enumerate(s.pods)),
        _check("short streams still complete", s.completed > 0, f"{s.completed} completed intact"),
        all_gone(s),
    ]


IN_ORDER = "notice, node, fetch, model, engine, pod, first token in order"


def _steps_in_order(s: Summary, c: ColdStart) -> Check:
    steps = c.steps(s.notice_at)
    missing = [name for name, at in steps if at is None]
    if missing:
        return _check(IN_ORDER, False, f"no {missing[0]}")
    times = [at for _, at in steps if at is not None]
    ordered = all(a <= b for a, b in itertools.pairwise(times))
    gaps = " -> ".join(
        name if index == 0 else f"{name} +{times[index] - times[index - 1]:.2f} s"
        for index, (name, _) in enumerate(steps)
    )
    return _check(IN_ORDER, ordered, gaps)


def _model_whole(c: ColdStart) -> Check:
    name = "the model on the replacement's cache is whole and identical to the source"
    if c.fetch_code != 0:
        return _check(name, False, "the fetch never exited" if c.fetch_code is None else f"fetch exited {c.fetch_code}")
    if c.model_problems:
        return _check(name, False, "; ".join(c.model_problems[:3]))
    return _check(name, True, f"{c.model_files} files: sizes and MD5s as the source's, and so is each in the manifest")


def _engine_after_model(c: ColdStart) -> Check:
    name = "the engine started only once the fetch had returned 0"
    if c.fetch_code != 0 or c.model_ready_at is None:
        started = c.engine_started_at is not None
        return _check(name, not started, f"no complete model; the engine {'started' if started else 'never started'}")
    if c.engine_started_at is None:
        return _check(name, False, "the fetch returned 0 but the engine never read the model")
    after = c.engine_started_at - c.model_ready_at
    if after < 0:
        return _check(name, False, f"the engine read the model {-after:.2f} s BEFORE the fetch returned")
    detail = f"the engine read {c.engine_files} of {c.model_files} files {after:.2f} s after the fetch returned 0"
    return _check(name, c.engine_files == c.model_files, detail)


def _first_token(s: Summary, c: ColdStart) -> Check:
    drained = {p.name for p in s.pods}
    served = c.first_token_at is not None and c.first_token_pod is not None and c.first_token_pod not in drained
    detail = f"{c.first_token_pod} served it" if served else "no first token from the replacement"
    if served and s.notice_at is not None and c.first_token_at is not None:
        detail += f", {c.first_token_at - s.notice_at:.2f} s after the notice"
    return _check("the replacement served a first token", served, detail)


def replacement_checks(s: Summary) -> list[Check]:
    c = s.cold_start
    if c is None:
        return [_check("a replacement node joined", False, "none did")]
    return [_steps_in_order(s, c), _model_whole(c), _engine_after_model(c), _first_token(s, c)]


def _cold_start(s: Summary) -> list[Check]:
    return [*_short_streams(s), *replacement_checks(s)]


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "short-streams",
            "Spot interruption; every stream is shorter than the deadline",
            "no stream is cut, every pod leaves rotation before its eviction, the node is empty before the deadline",
            Profile.SHORT,
            1,
            _short_streams,
        ),
        Scenario(
            "long-streams",
            "Spot interruption; half the streams are longer than the deadline",
            "the long streams are cut, and the sidecars report exactly as many cuts as the clients saw",
            Profile.MIXED,
            1,
            _long_streams,
        ),
        Scenario(
            "shipped-budget",
            "Spot interruption; two pods of one budget on the node, as deploy/vllm ships them (maxUnavailable: 1, "
            "unhealthyPodEvictionPolicy: AlwaysAllow)",
            "both pods are unready when evicted (their sidecars took them out of rotation), and both are evicted",
            Profile.SHORT,
            1,
            _shipped_budget,
            pods=2,
        ),
        Scenario(
            "pdb-blocks",
            "Spot interruption; a PodDisruptionBudget (maxUnavailable: 0, no AlwaysAllow) refuses every eviction",
            "the 429s are retried and reported, the pods go with the instance, and still no stream is cut",
            Profile.SHORT,
            0,
            _pdb_blocks,
            always_allow=False,
        ),
        Scenario(
            "agent-restart",
            "Spot interruption; the node agent is killed (SIGKILL) mid-drain and restarted",
            "the restarted agent resumes: the node is patched once, one Event, every pod evicted, no stream cut",
            Profile.SHORT,
            1,
            _agent_restart,
            restart_agent=True,
        ),
        Scenario(
            "node-lost",
            "the node vanishes with no notice: every process on it is killed (SIGKILL) at once",
            "nothing on the node can save its streams: each one open is cut, and the clients count them",
            Profile.MIXED,
            1,
            _node_lost,
            lose_node=True,
        ),
        Scenario(
            "sqs",
            "Spot interruption delivered as an EventBridge message through SQS (moto), node agent in queue mode",
            "the node is cordoned and drained, no stream is cut, and the message is deleted once done",
            Profile.SHORT,
            1,
            _sqs,
            via_sqs=True,
        ),
        Scenario(
            "sigterm-endings",
            "Spot interruption; streams longer than the deadline, and each pod's engine ends those left at its "
            "SIGTERM one of vLLM 0.32.0's ways: an abort chunk, an error event (each then [DONE]), or a hang",
            "every ending is seen as a cut stream and counted by the sidecar; an aborting or failing engine exits "
            "at once, a hung one is killed at the end of its grace period",
            Profile.MIXED,
            1,
            partial(_sigterm_endings, endings=ENDINGS),
            pods=len(ENDINGS),
            sigterm_endings=ENDINGS,
        ),
        Scenario(
            "cold-start",
            "Spot interruption; a replacement node joins, hydrates its model from S3 with `spotdrain cache fetch` in "
            "its engine pod's init container, and serves a first token",
            "the node drains with no stream cut; on the replacement the model lands whole and identical to the "
            "source before its engine starts, and the engine serves a first token",
            Profile.SHORT,
            1,
            _cold_start,
            cold_start=True,
        ),
        Scenario(
            "reasoning-streams",
            "Spot interruption; half the streams are chats that reason for longer than the deadline, half of those "
            "then call tools (vLLM's deepseek_r1 and hermes parsers)",
            "without the gateway the long chats are cut; through it each is continued and assembles to the "
            "uninterrupted stream's message",
            Profile.MIXED,
            1,
            reasoning_streams,
            chats=True,
            gateway_checks=reasoning_through_gateway,
        ),
    )
}


def _through_gateway(s: Summary) -> list[Check]:
    """With the gateway, a stream a pod could not finish is continued on the other node: clients see none cut."""
    out = [p.name for p in s.pods if p.out_at is None]
    return [
        _check("every pod left rotation", not out, f"still in rotation: {', '.join(out)}" if out else "all did"),
        _none_cut(s),
        _check(
            "every stream the sidecars cut was continued",
            s.continued >= s.cut_reported,
            f"sidecars reported {s.cut_reported} cut, the gateway continued {s.continued}",
        ),
        _check("short streams still complete", s.completed > 0, f"{s.completed} completed intact"),
        all_gone(s),
    ]


def judge(scenario: Scenario, summary: Summary, *, gateway: bool = False) -> tuple[Check, ...]:
    if gateway:
        checks = _through_gateway(summary)
        if scenario.lose_node:
            detail = f"{summary.continued} continuations"
            checks.append(_check("the lost node's streams continued elsewhere", summary.continued > 0, detail))
        if scenario.cold_start:
            checks += replacement_checks(summary)
        if scenario.gateway_checks is not None:
            checks += scenario.gateway_checks(summary)
        return tuple(checks)
    if scenario.lose_node:  # the sidecars died with the node: they report nothing, and nothing drains
        return tuple(scenario.checks(summary))
    return (*_common(summary), *scenario.checks(summary))
