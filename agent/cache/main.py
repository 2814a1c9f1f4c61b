"""``spotdrain cache`` and ``spotdrain cache fetch``, each loading only what it needs: a fetch (an inference pod's
init container) never loads the Kubernetes client, which alone would be half of its resident memory."""

from __future__ import annotations

import argparse


def main(args: argparse.Namespace) -> int:
    command = getattr(args, "cache_command", None)
    if command == "fetch":
        from agent.cache.fetch import run as fetch

        return fetch.main(args)
    if command == "prefetch":
        from agent.cache import prefetch

        return prefetch.main(args)
    from agent.cache import run

    return run.main(args)
