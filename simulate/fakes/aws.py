"""moto's server mode on 127.0.0.1 for tests, extended where it falls short of AWS.

- Auto Scaling's ``CompleteLifecycleAction`` and ``RecordLifecycleActionHeartbeat`` are not implemented in moto (its
  server answers them with a 500); here they answer as AWS does for an active lifecycle action.
- Every request is recorded with its action and parameters, so tests can check what was sent, in which order and how
  often (one ``DeleteMessage`` per message, ``CONTINUE`` with the message's token).
- Faults: the next requests for an action can be answered with an AWS error before moto sees them.
- Requests reach moto one at a time: its queues lose deletes that run concurrently, and SQS does not.
- Receiving from a queue of a thousand messages takes moto half a second, as it rebuilds every queue attribute for
  each message it checks against the retention period; here that check reads the one attribute it needs, so a burst
  measures the node agent rather than moto.
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from moto.autoscaling.exceptions import ValidationError
from moto.autoscaling.responses import AutoScalingResponse
from moto.core.responses import EmptyResult
from moto.core.utils import unix_time
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from moto.sqs.models import SQSBackend
from werkzeug.serving import BaseWSGIServer, make_server

REGION = "us-east-1"
ACCESS_KEY_ID = SECRET_ACCESS_KEY = "testing"

Environ = dict[str, Any]
StartResponse = Callable[[str, list[tuple[str, str]]], Any]
WsgiApp = Callable[[Environ, StartResponse], Iterable[bytes]]


@dataclass(frozen=True)
class Call:
    action: str
    params: dict[str, Any]
    at: float = field(default_factory=time.monotonic, compare=False)  # when it arrived, on the loop's clock


@dataclass(frozen=True)
class Fault:
    status: int
    code: str


def _lifecycle_action(self: Any) -> Any:
    # AWS needs the token or the instance id to find the lifecycle action, and the hook and group it belongs to.
    if not self._get_param("LifecycleHookName") or not self._get_param("AutoScalingGroupName"):
        raise ValidationError("LifecycleHookName and AutoScalingGroupName are required")
    if not self._get_param("LifecycleActionToken") and not self._get_param("InstanceId"):
        raise ValidationError("No active Lifecycle Action found: give LifecycleActionToken or InstanceId")
    return EmptyResult()


def _retained(self: Any, queue_name: str, message: Any) -> bool:
    retention_s = int(self.get_queue(queue_name).message_retention_period)
    return bool(retention_s + message.sent_timestamp / 1000 > unix_time())


def _request(environ: Environ) -> Call:
    """The action and parameters of a request, in either protocol (JSON with X-Amz-Target, or a query form)."""
    size = int(environ.get("CONTENT_LENGTH") or 0)
    body = environ["wsgi.input"].read(size) if size else b""
    environ["wsgi.input"] = io.BytesIO(body)
    target = environ.get("HTTP_X_AMZ_TARGET", "")
    if target:
        params = json.loads(body or b"{}")
        return Call(action=target.rpartition(".")[2], params=params if isinstance(params, dict) else {})
    form = dict(urllib.parse.parse_qsl(body.decode(errors="replace")))
    form.update(urllib.parse.parse_qsl(environ.get("QUERY_STRING", "")))
    return Call(action=form.pop("Action", ""), params=form)


def _error(environ: Environ, fault: Fault) -> tuple[str, list[tuple[str, str]], bytes]:
    status = f"{fault.status} Error"
    if environ.get("HTTP_X_AMZ_TARGET"):
        body = json.dumps({"__type": fault.code, "message": "injected fault"}).encode()
        headers = [("Content-Type", "application/x-amz-json-1.0"), ("x-amzn-query-error", f"{fault.code};Sender")]
        return status, headers, body
    xml = (
        "<ErrorResponse><Error><Type>Sender</Type>"
        f"<Code>{fault.code}</Code><Message>injected fault</Message>"
        "</Error><RequestId>fault</RequestId></ErrorResponse>"
    )
    return status, [("Content-Type", "text/xml")], xml.encode()


@dataclass
class MotoServer:
    """moto's server in a thread, on a port of its own; ``start()``, then ``endpoint_url``, then ``stop()``."""

    requests: list[Call] = field(default_factory=list)
    _faults: dict[str, list[Fault]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _serial: threading.Lock = field(default_factory=threading.Lock)
    _server: BaseWSGIServer | None = None
    _thread: threading.Thread | None = None
    _saved: dict[str, Any] = field(default_factory=dict)

    @property
    def endpoint_url(self) -> str:
        assert self._server is not None, "start() the server first"
        return f"http://127.0.0.1:{self._server.server_port}"

    def client(self, service: str, *, config: Any = None) -> Any:
        """A boto3 client of ``service`` on this server, with the test keys (``config``: botocore's ``Config``)."""
        import boto3  # comes with moto; only tests and benchmarks start this server

        make: Callable[..., Any] = boto3.client  # its overloads name each service by a literal
        return make(
            service,
            region_name=REGION,
            endpoint_url=self.endpoint_url,
            aws_access_key_id=ACCESS_KEY_ID,
            aws_secret_access_key=SECRET_ACCESS_KEY,
            config=config,
        )

    def calls(self, action: str, **match: Any) -> list[Call]:
        """Requests for ``action`` whose parameters include every ``match`` item, in the order they arrived."""
        with self._lock:
            return [
                call
                for call in self.requests
                if call.action == action and all(call.params.get(k) == v for k, v in match.items())
            ]

    def fail(self, action: str, *, status: int, code: str, times: int = 1) -> None:
        """Answer the next ``times`` requests for ``action`` with ``status`` and the AWS error ``code``."""
        with self._lock:
            self._faults.setdefault(action, []).extend([Fault(status, code)] * times)

    def _middleware(self, app: WsgiApp) -> WsgiApp:
        def recorded(environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
            call = _request(environ)
            with self._lock:
                self.requests.append(call)
                pending = self._faults.get(call.action)
                fault = pending.pop(0) if pending else None
            if fault is None:
                # moto's queues are not safe for concurrent changes (two deletes at once can bring a deleted
                # message back); AWS is, so requests that reach moto are served one at a time.
                with self._serial:
                    return list(app(environ, start_response))
            status, headers, body = _error(environ, fault)
            start_response(status, headers)
            return [body]

        return recorded

    def start(self) -> None:
        for name in ("complete_lifecycle_action", "record_lifecycle_action_heartbeat"):
            self._saved[name] = AutoScalingResponse.__dict__.get(name)
            setattr(AutoScalingResponse, name, _lifecycle_action)
        self._saved["retention"] = SQSBackend.is_message_valid_based_on_retention_period
        SQSBackend.is_message_valid_based_on_retention_period = _retained  # type: ignore[method-assign]
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request drowns a failing test's output
        app = self._middleware(DomainDispatcherApplication(create_backend_app))
        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="moto", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        SQSBackend.is_message_valid_based_on_retention_period = self._saved.pop("retention")  # type: ignore[method-assign]
        for name, original in self._saved.items():
            if original is None:
                delattr(AutoScalingResponse, name)
            else:
                setattr(AutoScalingResponse, name, original)


def main() -> None:
    """``python -m simulate.fakes.aws``: serve until SIGTERM, printing the endpoint URL on the first line."""
    import signal
    import sys

    server = MotoServer()
    server.start()
    print(server.endpoint_url, flush=True)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    signal.signal(signal.SIGINT, lambda *_: stopped.set())
    stopped.wait()
    server.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
