"""What the simulation learns from the programs' logs and from the fake API's node, as timeline entries.

The log translations are pure: one structlog event (a dict) in, at most one ``Note`` out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from simulate.timeline import Kind, Recorder

TAINT_KEY = "spotdrain.io/interruption"  # agent.drain.planning.TAINT_KEY; simulate/ never imports the agent
Fields = dict[str, Any]


@dataclass(frozen=True)
class Note:
    kind: Kind
    text: str
    pod: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


def _pod(fields: Fields) -> str | None:
    pod = fields.get("pod")
    return pod if isinstance(pod, str) else None


def agent_note(fields: Fields) -> Note | None:
    """The timeline entry for one of the node agent's log events, if it makes one."""
    event = fields.get("event")
    if event == "startup.ready":
        mode = "queue mode" if fields.get("queue_mode") else "IMDS mode"
        return Note(Kind.AGENT_STARTED, f"ready ({mode}), the Kubernetes API answers")
    if event == "notice.received":
        text = f"read the notice: {fields.get('kind')} from {fields.get('source')}, deadline {fields.get('deadline')}"
        return Note(Kind.AGENT_NOTICE, text)
    if event == "node.already_marked":
        return Note(Kind.ALREADY_MARKED, "found the node already marked for this notice: not marked again")
    if event == "pod.eviction_blocked":
        text = f"eviction refused ({fields.get('error')}); retry in {fields.get('retry_in_s')} s"
        return Note(Kind.EVICTION_BLOCKED, text, pod=_pod(fields))
    if event == "pod.eviction_failed":
        return Note(Kind.EVICTION_FAILED, f"eviction given up: {fields.get('error')}", pod=_pod(fields))
    if event == "node.drained":
        return Note(Kind.NODE_DRAINED, "drain of the node returned")
    if event == "sqs.message_done":
        return Note(Kind.MESSAGE_DELETED, f"deleted the message from the queue ({fields.get('outcome')})")
    return None


def gateway_note(fields: Fields) -> Note | None:
    """The timeline entry for one of the gateway's log events: each continuation."""
    event = fields.get("event")
    if event == "gateway.continued":
        text = f"a stream broken by {fields.get('cause')} continues elsewhere after {fields.get('tokens_sent')} tokens"
        return Note(Kind.CONTINUED, text)
    return None


def sidecar_note(fields: Fields, *, pod: str) -> Note | None:
    """The timeline entry for one of a sidecar's log events, if it makes one."""
    event = fields.get("event")
    if event == "drain.started":
        return Note(Kind.DRAIN_STARTED, f"sidecar starts draining ({fields.get('reason')})", pod=pod)
    if event in ("drain.finished", "drain.timeout"):
        cut = fields.get("streams_cut")
        outcome = fields.get("outcome")
        text = f"sidecar drain ended: {outcome} after {fields.get('duration_s')} s, reports {cut} streams cut"
        return Note(Kind.DRAINED, text, pod=pod, data={"outcome": outcome, "streams_cut": cut})
    return None


def fetch_note(fields: Fields, *, pod: str) -> Note | None:
    """The timeline entry for one of ``spotdrain cache fetch``'s log events in a pod's init container."""
    event = fields.get("event")
    if event == "cache.fetch_started":
        size = fields.get("total_bytes")
        mib = f"{size / 2**20:.1f} MiB" if isinstance(size, int) else "?"
        files, source = fields.get("files"), fields.get("source")
        text = f"init container: spotdrain cache fetch copies {files} files ({mib}) from {source}"
        return Note(Kind.FETCH_STARTED, text, pod=pod)
    return None


def engine_cut(fields: Fields) -> int | None:
    """The engine's own count of the streams it cut, from its last log line."""
    cut = fields.get("cut")
    return cut if fields.get("event") == "engine.stopped" and isinstance(cut, int) else None


def note_taker(
    recorder: Recorder, subject: str, translate: Callable[[Fields], Note | None]
) -> Callable[[Fields], None]:
    """A process listener that records what ``translate`` makes of each log event."""

    def listen(fields: Fields) -> None:
        note = translate(fields)
        if note is not None:
            recorder.record(note.kind, note.pod or subject, note.text, pod=note.pod, **note.data)

    return listen


def node_marks(node: Fields) -> dict[Kind, str]:
    """What the agent has done to the node so far: its taint and its cordon."""
    spec = node.get("spec") or {}
    marks: dict[Kind, str] = {}
    for taint in spec.get("taints") or []:
        if taint.get("key") == TAINT_KEY:
            marks[Kind.TAINTED] = f"tainted {TAINT_KEY}={taint.get('value')}:{taint.get('effect')}"
    if spec.get("unschedulable"):
        marks[Kind.CORDONED] = "cordoned (spec.unschedulable)"
    return marks


async def node_watcher(read: Callable[[], Fields], recorder: Recorder, *, name: str, interval_s: float = 0.02) -> None:
    """Records the node's taint and cordon as they appear in the fake API; runs until cancelled.

    The fake API serves no watches and lives in this process, so reading it often costs next to nothing.
    """
    seen: set[Kind] = set()
    while True:
        for kind, text in node_marks(read()).items():
            if kind not in seen:
                seen.add(kind)
                recorder.record(kind, f"node {name}", text)
        await asyncio.sleep(interval_s)
