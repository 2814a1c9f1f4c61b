from __future__ import annotations

import pytest

from gateway.settings import from_arguments
from spotdrain.cli import build_parser, main
from spotdrain.settings import SettingsError


def test_backends_come_from_repeated_flags_or_one_comma_separated_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ["gateway", "--backend", "http://a:8000/", "--backend", "http://b:8000"]
    assert from_arguments(build_parser().parse_args(flags)).backends == ("http://a:8000", "http://b:8000")
    monkeypatch.setenv("SPOTDRAIN_BACKEND", "http://c:1, http://d:2")
    monkeypatch.setenv("SPOTDRAIN_MIGRATION_LIMIT", "5")
    settings = from_arguments(build_parser().parse_args(["gateway"]))
    assert settings.backends == ("http://c:1", "http://d:2")
    assert settings.migration.limit == 5
    assert settings.max_body_bytes == 16 * 1024 * 1024


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["gateway"], "either --backend"),
        (["gateway", "--backend", "http://a", "--service", "ml/vllm"], "not both"),
        (["gateway", "--service", "vllm"], "NAMESPACE/NAME"),
        (["gateway", "--service", "ml/vllm", "--ready-url", "http://a:1/ready"], "--ready-url goes with --backend"),
        (["gateway", "--backend", "http://a", "--backend", "http://a"], "twice"),
        (["gateway", "--backend", "http://a", "--read-timeout", "0"], "--read-timeout"),
        (
            ["gateway", "--backend", "http://a", "--backend", "http://b", "--ready-url", "http://a:1/ready"],
            "one --ready-url",
        ),
    ],
)
def test_settings_that_cannot_work_are_refused_with_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        from_arguments(build_parser().parse_args(argv))


def test_a_bad_backend_variable_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPOTDRAIN_BACKEND", "ftp://x")
    assert main(["gateway"]) == 2
    assert "SPOTDRAIN_BACKEND" in capsys.readouterr().err
