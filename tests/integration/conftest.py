"""Servers shared by the integration tests: moto's AWS server, started once per module."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import pytest

from simulate.fakes.aws import ACCESS_KEY_ID, SECRET_ACCESS_KEY, MotoServer

if TYPE_CHECKING:
    from mypy_boto3_sqs import SQSClient


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    server = MotoServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    # The source finds credentials the way it does in a pod: the SDKs' default chain, here the environment.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture
def sqs(moto: MotoServer, aws_credentials: None) -> SQSClient:
    return cast("SQSClient", moto.client("sqs"))


@pytest.fixture
def queue(sqs: SQSClient) -> str:
    return sqs.create_queue(QueueName=f"interruptions-{uuid.uuid4().hex[:12]}")["QueueUrl"]
