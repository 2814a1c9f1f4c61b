from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.node_settings import API_LIMITS, NodeSettings
from agent.node_settings import from_arguments as node_from_arguments
from sidecar.settings import SidecarSettings, from_arguments
from spotdrain.cli import build_parser, main
from spotdrain.settings import SettingsError, env_name


def settings_for(*argv: str) -> SidecarSettings:
    return from_arguments(build_parser().parse_args(["sidecar", *argv]))


def test_every_flag_reads_its_spotdrain_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTDRAIN_POLL_INTERVAL", "0.2")
    monkeypatch.setenv("SPOTDRAIN_ENGINE", "tgi")
    monkeypatch.setenv("SPOTDRAIN_READINESS_GATE", "false")
    settings = settings_for()
    assert settings.drain.poll_interval_s == 0.2
    assert settings.engine.kind == "tgi"
    assert settings.gate.enabled is False


def test_a_flag_wins_over_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTDRAIN_DRAIN_TIMEOUT", "30")
    assert settings_for("--drain-timeout", "45.5").drain.timeout_s == 45.5


def test_env_names_follow_the_flag() -> None:
    assert env_name("--in-flight-metric") == "SPOTDRAIN_IN_FLIGHT_METRIC"


def test_defaults_match_the_documented_ones() -> None:
    settings = settings_for()
    assert settings.engine.url == "http://127.0.0.1:8000"
    assert settings.engine.port == 8000
    assert settings.drain.dir == Path("/run/spotdrain")
    assert (settings.drain.timeout_s, settings.drain.endpoint_delay_s, settings.drain.poll_interval_s) == (110, 5, 0.5)


def test_a_bad_variable_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTDRAIN_POLL_INTERVAL", "soon")
    with pytest.raises(SettingsError, match="SPOTDRAIN_POLL_INTERVAL='soon'"):
        build_parser()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine", "custom"], "--engine custom needs --in-flight-metric"),
        (["--poll-interval", "0"], "--poll-interval must be above 0"),
        (["--readiness-gate", "--pod-namespace", "ns"], "--readiness-gate needs --pod-name"),
    ],
)
def test_invalid_combinations_are_refused_with_the_reason(argv: list[str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        settings_for(*argv)


def test_the_sidecar_long_polls_for_30_s_by_default_and_polls_with_a_wait_of_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert settings_for().drain.notice_wait_s == 30
    monkeypatch.setenv("SPOTDRAIN_NOTICE_WAIT", "0")
    assert settings_for().drain.notice_wait_s == 0
    assert settings_for("--notice-wait", "12.5").drain.notice_wait_s == 12.5
    with pytest.raises(SystemExit):
        settings_for("--notice-wait", "-1")


def test_pod_identity_comes_from_the_downward_api_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "vllm-0")
    monkeypatch.setenv("POD_NAMESPACE", "inference")
    settings = settings_for("--readiness-gate")
    assert (settings.gate.pod_name, settings.gate.pod_namespace) == ("vllm-0", "inference")


def test_the_command_exits_2_with_a_clear_message(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTDRAIN_STALL_AFTER", "-3")
    assert main(["sidecar"]) == 2
    assert "SPOTDRAIN_STALL_AFTER='-3'" in capsys.readouterr().err


def test_bad_urls_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sidecar", "--engine-url", "localhost:8000"])
    assert "not an http(s) URL" in capsys.readouterr().err


def test_the_node_agent_without_a_usable_kubeconfig_says_so_and_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "kubeconfig").write_text("apiVersion: v1\nkind: Config\n")
    assert main(["node", "--node-name", "gpu-1", "--kubeconfig", str(tmp_path / "kubeconfig")]) == 2
    assert "cannot reach the Kubernetes API through kubeconfig" in capsys.readouterr().err


def test_queue_mode_needs_a_region(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_REGION", raising=False)
    assert main(["node", "--queue-url", "https://sqs.us-east-1.amazonaws.com/1/q"]) == 2
    assert "--queue-url needs --aws-region" in capsys.readouterr().err


def node_settings_for(*argv: str) -> NodeSettings:
    return node_from_arguments(build_parser().parse_args(["node", "--node-name", "gpu-1", *argv]))


def test_the_node_agent_bounds_api_calls_and_stalls_by_default_and_by_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = node_settings_for()
    assert (defaults.kube.timeout_s, defaults.drain.progress_timeout_s) == (10.0, 60.0)
    monkeypatch.setenv("SPOTDRAIN_API_TIMEOUT", "2.5")
    monkeypatch.setenv("SPOTDRAIN_PROGRESS_TIMEOUT", "30")
    settings = node_settings_for()
    assert (settings.kube.timeout_s, settings.drain.progress_timeout_s) == (2.5, 30.0)


@pytest.mark.parametrize("flag", ["--api-timeout", "--progress-timeout"])
def test_an_unbounded_timeout_is_refused(flag: str) -> None:
    with pytest.raises(SettingsError, match=f"{flag} must be above 0"):
        node_settings_for(flag, "0")


def test_liveness_outlasts_the_pause_before_evicting() -> None:
    with pytest.raises(SettingsError, match="--progress-timeout must be longer than --eviction-delay"):
        node_settings_for("--eviction-delay", "90")


QUEUE = ("--queue-url", "https://sqs.us-east-1.amazonaws.com/1/q", "--aws-region", "us-east-1")


def test_the_api_rate_limit_defaults_to_karpenters_in_queue_mode_and_stays_low_on_a_node() -> None:
    queue = node_from_arguments(build_parser().parse_args(["node", *QUEUE]))
    assert (queue.kube.qps, queue.kube.burst) == API_LIMITS["queue"] == (200.0, 300)
    imds = node_settings_for()
    assert (imds.kube.qps, imds.kube.burst) == API_LIMITS["imds"] == (10.0, 20)


@pytest.mark.parametrize("mode", [QUEUE, ("--node-name", "gpu-1")])
def test_a_given_api_rate_limit_wins_over_the_modes_by_flag_or_variable(
    mode: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = node_from_arguments(build_parser().parse_args(["node", *mode, "--api-qps", "50"]))
    assert settings.kube.qps == 50
    monkeypatch.setenv("SPOTDRAIN_API_BURST", "70")
    assert node_from_arguments(build_parser().parse_args(["node", *mode])).kube.burst == 70


def test_help_says_the_api_rate_limit_of_each_mode(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["node", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "default: 200 in queue mode (Karpenter's), 10 in IMDS mode" in help_text
    assert "default: 300 in queue mode (Karpenter's), 20 in IMDS mode" in help_text
    assert "default: the in-cluster service account, else ~/.kube/config" in help_text


def test_an_error_after_a_global_option_names_the_subcommand_from_the_real_command_line(tmp_path: Path) -> None:
    argv = [str(Path(sys.executable).with_name("spotdrain")), "--log-format", "console", "node", *QUEUE[:2]]
    env = {key: value for key, value in os.environ.items() if key not in ("AWS_REGION", "SPOTDRAIN_AWS_REGION")}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr.startswith("spotdrain node: error: --queue-url needs --aws-region"), done.stderr


def test_an_error_in_a_variable_read_before_parsing_names_the_subcommand(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPOTDRAIN_API_TIMEOUT", "never")
    assert main(["--log-level", "debug", "node", "--node-name", "gpu-1"]) == 2
    assert capsys.readouterr().err.startswith("spotdrain node: error: SPOTDRAIN_API_TIMEOUT='never'")
