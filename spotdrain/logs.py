"""structlog, set up once per process: JSON lines in a cluster, readable columns on a terminal."""

from __future__ import annotations

import logging
import sys

import structlog


class _Stderr:
    """Whatever ``sys.stderr`` is at the time of writing: loggers are cached, the stream may be replaced later."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(*, json: bool | None = None, level: str = "info") -> None:
    """Send structured events to stderr; ``json=None`` picks JSON unless stderr is a terminal."""
    as_json = not sys.stderr.isatty() if json is None else json
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%Y-%m-%dT%H:%M:%S.%fZ", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        # One write per line: Python's stderr writes through, and print() writes the line and its newline apart,
        # so processes sharing a stderr (the gateway's workers) merged their lines
        logger_factory=structlog.WriteLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
