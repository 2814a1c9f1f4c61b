"""The flags that say what a pod gets, shared by both front ends of ``inject.pods``: ``spotdrain inject`` and
``spotdrain webhook`` take the same options with the same names, defaults and ``SPOTDRAIN_*`` variables."""

from __future__ import annotations

import argparse

from inject.spec import DEFAULT_IMAGE, DEFAULT_NOTICE_URL, ENGINE_PORTS, Options
from spotdrain.settings import add_flag, add_switch, require, seconds


def add_options(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--sidecar-image", default=DEFAULT_IMAGE, help="the sidecar's image")
    # No `choices`: SPOTDRAIN_ENGINE is also the sidecar's variable, and may hold a value only the sidecar takes
    # (custom); checked when inject runs, it cannot break the parser of every other command.
    add_flag(parser, "--engine", default="auto", help="auto (told by the image or command), vllm, tgi or sglang")
    add_flag(parser, "--container", help="the engine container's name (default: found by image or command)")
    add_flag(parser, "--drain-timeout", convert=seconds, default=110.0, help="the sidecar's --drain-timeout")
    add_flag(parser, "--notice-url", default=DEFAULT_NOTICE_URL, help="the sidecar's --notice-url ('' for none)")
    add_switch(
        parser,
        "--readiness-gate",
        default=False,
        help="add the spotdrain.io/serving readiness gate (the pod's account needs patch on pods/status)",
    )


def options_from(args: argparse.Namespace) -> Options:
    require(args.drain_timeout > 0, "--drain-timeout must be above 0 seconds")
    engines = ("auto", *ENGINE_PORTS)
    require(args.engine in engines, f"--engine {args.engine!r}: choose from {', '.join(engines)}")
    return Options(
        image=args.sidecar_image,
        engine=args.engine,
        container=args.container,
        drain_timeout_s=args.drain_timeout,
        notice_url=args.notice_url or None,
        readiness_gate=args.readiness_gate,
    )
