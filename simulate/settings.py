"""The simulation's settings: the ``spotdrain simulate`` flags, and every duration derived from the notice.

Time is compressed: a notice of ``--notice-seconds`` stands for the 120 s a Spot interruption gives, and the
programs' durations are scaled to fit it. One duration does not scale: the sidecar ends a drain 10 s before a
notice's deadline (room for the engine to exit), so a notice of N seconds leaves N - 10 seconds to drain.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

from spotdrain.settings import add_flag, add_switch, positive_int, require, seconds

SPOT_NOTICE_S = 120.0
ENGINE_EXIT_MARGIN_S = 10.0  # sidecar.draining.ENGINE_EXIT_MARGIN; not imported, this module must stay light
MIN_WINDOW_S = 2.0
SCENARIO_NAMES = (
    "short-streams",
    "long-streams",
    "shipped-budget",
    "pdb-blocks",
    "agent-restart",
    "node-lost",
    "sqs",
    "sigterm-endings",
    "cold-start",
    "reasoning-streams",
)
# The scenarios another way of handling the notice can play too: a notice, and nothing that is spotdrain's own.
COMPARABLE = ("short-streams", "long-streams", "shipped-budget", "pdb-blocks")


@dataclass(frozen=True)
class Timings:
    notice_s: float
    window_s: float  # how long a drain may last after the notice: the sidecar's drain timeout
    endpoint_delay_s: float
    eviction_margin_s: float
    grace_s: int  # the pods' own terminationGracePeriodSeconds
    warmup_s: float  # load before the notice
    eviction_delay_s: float = 1.0  # the agent's pause between publishing the notice and evicting
    poll_s: float = 0.2  # the sidecars' engine readings and notice polls
    imds_interval_s: float = 0.2
    router_poll_s: float = 0.1  # as endpoints follow readiness

    @property
    def scale(self) -> float:
        """The simulation's seconds per second of a real 120 s notice: how the other ways' durations are scaled."""
        return self.notice_s / SPOT_NOTICE_S

    @classmethod
    def scaled(cls, notice_s: float) -> Timings:
        """Scale the defaults of a 120 s notice (drain 110 s, endpoint delay 5 s, eviction margin 5 s, grace 130 s)."""
        scale = notice_s / SPOT_NOTICE_S
        window_s = notice_s - ENGINE_EXIT_MARGIN_S
        return cls(
            notice_s=notice_s,
            window_s=window_s,
            endpoint_delay_s=round(max(0.3, 5.0 * scale), 2),  # at least three router polls
            eviction_margin_s=round(max(1.0, 5.0 * scale), 2),  # grace periods are whole seconds
            grace_s=math.ceil(notice_s) + 10,
            warmup_s=round(0.5 + 0.2 * window_s, 2),
        )


@dataclass(frozen=True)
class SimulationSettings:
    scenario: str
    pods: int
    streams_per_pod: int
    tokens_per_s: float
    seed: int
    timings: Timings
    json: bool = False
    html: Path | None = None
    log_dir: Path | None = None
    gateway: bool = False  # spotdrain gateway in front of the router, and a second node that is not interrupted
    compare: bool = False  # play the scenario once per way of handling the notice (simulate.baselines)
    engine: str = "fake"  # or "vllm": real vLLM processes (simulate.vllm) serve the pods instead of the fake engine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--scenario", default="short-streams", choices=SCENARIO_NAMES, help="what to play")
    add_flag(parser, "--pods", convert=positive_int, default=3, help="inference pods on the node")
    add_flag(parser, "--streams-per-pod", convert=positive_int, default=4, help="concurrent streams per pod")
    add_flag(parser, "--notice-seconds", convert=seconds, default=20.0, help="the notice, standing for 120 s")
    add_flag(parser, "--tokens-per-second", convert=float, default=20.0, help="each fake engine's stream speed")
    add_flag(parser, "--seed", convert=int, default=1, help="seed of the stream lengths")
    add_switch(parser, "--json", default=False, help="print the result as JSON instead of the timeline")
    add_flag(parser, "--html", convert=Path, help="also write the timeline as a self-contained HTML page")
    add_flag(parser, "--log-dir", convert=Path, help="keep every process's log here (default: a temporary dir)")
    add_switch(
        parser, "--gateway", default=False, help="clients go through spotdrain gateway; a second node takes over"
    )
    add_switch(
        parser, "--compare", default=False, help="play the scenario with spotdrain and each other way, side by side"
    )
    # Not read from SPOTDRAIN_ENGINE: that variable is the sidecar's --engine, set in pods' environments.
    parser.add_argument(
        "--engine",
        default="fake",
        choices=("fake", "vllm"),
        help="the pods' engine: the fake, or real vLLM (default: fake)",
    )


def from_arguments(args: argparse.Namespace) -> SimulationSettings:
    """Build and validate the settings; raises SettingsError with the flag's name and the reason."""
    least = ENGINE_EXIT_MARGIN_S + MIN_WINDOW_S
    require(
        args.notice_seconds >= least,
        f"--notice-seconds must be at least {least:g}: the sidecar ends a drain {ENGINE_EXIT_MARGIN_S:g} s before "
        "the deadline, and the streams need the rest",
    )
    require(args.pods <= 20, "--pods must be at most 20 (each pod is two processes)")
    require(args.streams_per_pod <= 50, "--streams-per-pod must be at most 50")
    require(args.tokens_per_second > 0, "--tokens-per-second must be above 0")
    require(
        args.engine == "fake" or args.scenario != "reasoning-streams",
        "--scenario reasoning-streams needs the fake engine's thinking model",
    )
    require(
        not args.compare or args.scenario in COMPARABLE,
        f"--compare plays one of {', '.join(COMPARABLE)}: the others have no notice or play spotdrain's own parts",
    )
    require(not (args.compare and args.gateway), "--compare plays the node without the gateway")
    require(args.engine == "fake" or not args.compare, "--compare plays the fake engine (one set of pods per way)")
    require(
        args.engine == "fake" or args.scenario != "sigterm-endings",
        "--scenario sigterm-endings chooses each fake engine's ending; real vLLM picks its own",
    )
    require(
        args.engine == "fake" or args.scenario != "cold-start",
        "--scenario cold-start hydrates a made-up checkpoint that only the fake engine reads",
    )
    require(
        args.engine == "fake" or args.pods * (2 if args.gateway else 1) <= 4,
        "--engine vllm runs at most 4 vLLM servers (about 3 GB each): lower --pods",
    )
    return SimulationSettings(
        scenario=args.scenario,
        pods=args.pods,
        streams_per_pod=args.streams_per_pod,
        tokens_per_s=args.tokens_per_second,
        seed=args.seed,
        timings=Timings.scaled(args.notice_seconds),
        json=args.json,
        html=args.html,
        log_dir=args.log_dir,
        gateway=args.gateway,
        compare=args.compare,
        engine=args.engine,
    )
