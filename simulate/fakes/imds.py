"""A fake EC2 instance metadata service that behaves like IMDSv2, with a control API to schedule notices and outages.

Tokens come from ``PUT /latest/api/token`` (TTL 1-21600 s, no ``X-Forwarded-For``); every GET needs a valid one
unless the fake allows IMDSv1. Tests call the control methods directly; another process drives the same methods
with ``POST /_control/<method>`` and a JSON object of keyword arguments. ``python -m simulate.fakes.imds --port 8080``
runs it on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, Protocol

import aiohttp
import structlog
from aiohttp import web

from spotdrain.clock import rfc3339

log = structlog.get_logger()

TOKEN_PATH = "/latest/api/token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
MAX_TTL_S = 21600
META = "/latest/meta-data/"
CONTROL = frozenset(
    {
        "schedule_spot",
        "schedule_rebalance",
        "add_maintenance",
        "set_maintenance_state",
        "set_lifecycle_state",
        "clear",
        "fail_next",
        "set_delay",
        "expire_tokens",
        "set_token_ttl",
        "answer_tokens_with",
        "request_counts",
    }
)
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")

Time = datetime | str  # a string is served as given, so tests can also serve malformed times


def maintenance_time(moment: datetime) -> str:
    """IMDS's format for scheduled events, ``21 Jan 2019 09:00:43 GMT``, whatever the locale."""
    utc = moment.astimezone(UTC)
    return f"{utc.day} {_MONTHS[utc.month - 1]} {utc.year} {utc:%H:%M:%S} GMT"


def _stamp(value: Time, fmt: Callable[[datetime], str] = rfc3339) -> str:
    return fmt(value) if isinstance(value, datetime) else value


class FakeImds:
    """The metadata of one instance, its notices, and the failures to inject; ``requests`` counts requests by path."""

    def __init__(
        self,
        *,
        instance_id: str = "i-0123456789abcdef0",
        availability_zone: str = "us-east-1a",
        allow_v1: bool = False,
        lifecycle_state: str | None = None,
        role: str | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.role = role  # the instance profile's role, whose credentials iam/security-credentials/ gives
        self.availability_zone = availability_zone
        self.allow_v1 = allow_v1
        self.requests: Counter[str] = Counter()
        self.refused = 0  # GETs answered 401
        self._tokens: dict[str, float] = {}  # token -> monotonic expiry
        self._token_ttl_s: float | None = None
        self._token_body: str | bytes | None = None
        self._failures: dict[str, list[tuple[int, int]]] = {}
        self._delay_s = 0.0
        self._lifecycle = lifecycle_state
        self._spot: dict[str, str] | None = None
        self._rebalance: dict[str, str] | None = None
        self._maintenance: list[dict[str, str]] = []

    # Control: notices

    def schedule_spot(self, action: str = "terminate", time: Time = "2026-11-29T10:22:00Z") -> None:
        self._spot = {"action": action, "time": _stamp(time)}

    def schedule_rebalance(self, time: Time = "2026-11-29T10:20:00Z") -> None:
        self._rebalance = {"noticeTime": _stamp(time)}

    def add_maintenance(
        self,
        *,
        code: str = "system-reboot",
        not_before: Time = "21 Jan 2019 09:00:43 GMT",
        not_after: Time | None = None,
        description: str = "scheduled reboot",
        state: str = "active",
        event_id: str | None = None,
    ) -> str:
        """Schedule an event; returns its EventId (``instance-event-`` and 17 hex digits, unless given)."""
        event_id = event_id or "instance-event-" + secrets.token_hex(9)[:17]
        event = {
            "Code": code,
            "Description": description,
            "EventId": event_id,
            "NotBefore": _stamp(not_before, maintenance_time),
            "NotAfter": _stamp(not_after if not_after is not None else not_before, maintenance_time),
            "State": state,
        }
        self._maintenance.append(event)
        return event_id

    def set_maintenance_state(self, event_id: str, state: str) -> None:
        for event in self._maintenance:
            if event["EventId"] == event_id:
                event["State"] = state
                return
        raise KeyError(event_id)

    def set_lifecycle_state(self, text: str | None) -> None:
        """``InService``, ``Terminated``...; None takes the instance out of its Auto Scaling group (404)."""
        self._lifecycle = text

    def clear(self) -> None:
        """No notices, no failures, no delay; tokens and counters stay."""
        self._spot = self._rebalance = None
        self._maintenance.clear()
        self._failures.clear()
        self._delay_s = 0.0

    # Control: failures

    def fail_next(self, path: str, status: int = 500, count: int = 1) -> None:
        """Answer the next ``count`` requests for ``path`` (``*``: any path) with ``status`` (500, 503, 429...)."""
        self._failures.setdefault(path, []).append((status, count))

    def set_delay(self, seconds: float) -> None:
        """Wait this long before answering each request, to make clients time out."""
        self._delay_s = seconds

    def expire_tokens(self) -> None:
        """Every token issued so far is invalid from now on, as after a stop and start."""
        self._tokens.clear()

    def set_token_ttl(self, seconds: float | None) -> None:
        """Tokens issued from now on expire after ``seconds`` whatever was asked (None: as asked). The answer still
        states the TTL asked for, so a client learns of the expiry only from a 401."""
        self._token_ttl_s = seconds

    def answer_tokens_with(self, body: str | bytes | None) -> None:
        """Answer token requests 200 with ``body`` instead of a token (None: tokens again), as a captive proxy or a
        misrouted hop in front of IMDS does: an HTML login page, a JSON error, anything."""
        self._token_body = body

    def role_credentials(self) -> dict[str, str]:
        """The instance role's credentials as IMDS gives them: valid for six hours from now."""
        expiry = datetime.fromtimestamp(time.time() + 6 * 3600, UTC)
        return {
            "Code": "Success",
            "LastUpdated": rfc3339(datetime.now(UTC)),
            "Type": "AWS-HMAC",
            "AccessKeyId": f"ASIA{self.instance_id[-12:].upper()}",
            "SecretAccessKey": f"secret-of-{self.role}",
            "Token": f"token-of-{self.role}",
            "Expiration": rfc3339(expiry),
        }

    def request_counts(self) -> dict[str, int]:
        return dict(self.requests)

    # Serving

    def _injected(self, path: str) -> int | None:
        for key in (path, "*"):
            queue = self._failures.get(key)
            if queue:
                status, count = queue[0]
                queue[0] = (status, count - 1)
                if count <= 1:
                    queue.pop(0)
                return status
        return None

    def _valid(self, token: str) -> bool:
        expiry = self._tokens.get(token)
        return expiry is not None and time.monotonic() < expiry

    def _issue(self, request: web.Request) -> web.Response:
        if "X-Forwarded-For" in request.headers:
            return web.Response(status=403, text="Forbidden")
        raw = request.headers.get(TTL_HEADER, "")
        if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= MAX_TTL_S:
            return web.Response(status=400, text="Bad Request")
        token = secrets.token_urlsafe(42)
        lifetime = self._token_ttl_s if self._token_ttl_s is not None else int(raw)
        self._tokens[token] = time.monotonic() + lifetime
        return web.Response(text=token, headers={TTL_HEADER: raw})

    def _authorized(self, request: web.Request) -> bool:
        token = request.headers.get(TOKEN_HEADER)
        if token is None:
            return self.allow_v1
        return self._valid(token)  # an invalid token is refused even where IMDSv1 is allowed

    def _metadata(self, path: str) -> web.Response:
        plain: dict[str, str | None] = {
            "instance-id": self.instance_id,
            "placement/availability-zone": self.availability_zone,
            "autoscaling/target-lifecycle-state": self._lifecycle,
        }
        documents: dict[str, Any] = {
            "spot/instance-action": self._spot,
            "events/recommendations/rebalance": self._rebalance,
            "events/maintenance/scheduled": self._maintenance,
        }
        if self.role is not None:
            # https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instancedata-data-categories.html: the role's name,
            # then its temporary credentials as JSON.
            plain["iam/security-credentials/"] = self.role
            documents[f"iam/security-credentials/{self.role}"] = self.role_credentials()
        key = path.removeprefix(META)
        text = plain.get(key)
        if text is None and documents.get(key) is not None:
            text = json.dumps(documents[key])
        return web.Response(text=text) if text is not None else web.Response(status=404, text="Not Found")

    async def metadata(self, request: web.Request) -> web.Response:
        path = request.path
        self.requests[path] += 1
        if self._delay_s:
            await asyncio.sleep(self._delay_s)
        status = self._injected(path)
        if status is not None:
            return web.Response(status=status, text=f"injected HTTP {status}")
        if request.method == "PUT" and path == TOKEN_PATH and self._token_body is not None:
            body = self._token_body
            return web.Response(body=body.encode() if isinstance(body, str) else body, content_type="text/html")
        if request.method == "PUT":
            return self._issue(request) if path == TOKEN_PATH else web.Response(status=405)
        if not self._authorized(request):
            self.refused += 1
            return web.Response(status=401, text="Unauthorized")
        return self._metadata(path) if path.startswith(META) else web.Response(status=404, text="Not Found")

    async def control(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in CONTROL:
            return web.json_response({"error": f"no control method {name}"}, status=404)
        try:
            arguments = await request.json() if request.can_read_body else {}
            result = getattr(self, name)(**arguments)
        except (ValueError, TypeError, KeyError) as error:
            return web.json_response({"error": f"{type(error).__name__}: {error}"}, status=400)
        return web.json_response({"result": result})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/_control/{name}", self.control)
        app.router.add_route("*", "/latest/{tail:.*}", self.metadata)
        return app


class Served(Protocol):
    """A fake with an aiohttp application of its own."""

    def app(self) -> web.Application: ...


@asynccontextmanager
async def serving(fake: Served, *, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Serve ``fake`` while the block runs; yields its base URL (``port=0`` picks a free port)."""
    runner = web.AppRunner(fake.app(), access_log=None, handle_signals=False, shutdown_timeout=0.1)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
        bound = runner.addresses[0][1]
        yield f"http://{host}:{bound}"
    finally:
        await asyncio.shield(runner.cleanup())


async def control(session: aiohttp.ClientSession, base_url: str, method: str, **arguments: Any) -> Any:
    """Call one control method of a fake running elsewhere; returns what the method returned."""
    async with session.post(f"{base_url}/_control/{method}", json=arguments) as response:
        answer = await response.json()
        if response.status != 200:
            raise RuntimeError(f"control {method} failed: {answer.get('error')}")
        return answer["result"]


def main(argv: list[str] | None = None) -> None:
    from spotdrain.logs import configure_logging

    parser = argparse.ArgumentParser(prog="python -m simulate.fakes.imds", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--instance-id", default="i-0123456789abcdef0")
    parser.add_argument("--availability-zone", default="us-east-1a")
    parser.add_argument("--allow-v1", action="store_true", help="answer GETs without a token (IMDSv1)")
    parser.add_argument("--lifecycle-state", default=None, help="in an Auto Scaling group, in this state")
    parser.add_argument("--role", default=None, help="the instance profile's role, whose credentials it serves")
    args = parser.parse_args(argv)
    configure_logging()
    fake = FakeImds(
        instance_id=args.instance_id,
        availability_zone=args.availability_zone,
        allow_v1=args.allow_v1,
        lifecycle_state=args.lifecycle_state,
        role=args.role,
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with serving(fake, host=args.host, port=args.port) as url:
            log.info("imds.listening", url=url, instance=fake.instance_id)
            await stop.wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
