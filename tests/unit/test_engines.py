from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.engines import ENGINES, MetricsError, custom_engine, in_flight, read_engine, sum_samples

VLLM_TWO_ENGINES = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1200.0
vllm:generation_tokens_total{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 800.0
vllm:generation_tokens_created{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7e+09
"""

TGI = """\
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 4
# TYPE tgi_queue_size gauge
tgi_queue_size 2
# TYPE tgi_batch_inference_count counter
tgi_batch_inference_count{method="prefill"} 10
tgi_batch_inference_count{method="decode"} 300
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 5.0
sglang:num_running_reqs{engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="1"} 5.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="qwen",pp_rank="0",tp_rank="0"} 1.0
"""


def test_vllm_sums_running_and_waiting_over_every_engine_label_set() -> None:
    reading = read_engine(VLLM_TWO_ENGINES, ENGINES["vllm"])
    assert reading.in_flight == 6
    assert reading.tokens == 2000.0


def test_tgi_adds_batch_and_queue() -> None:
    reading = read_engine(TGI, ENGINES["tgi"])
    assert reading.in_flight == 6
    assert reading.tokens == 310


def test_sglang_sums_ranks_and_queue() -> None:
    assert in_flight(SGLANG, ENGINES["sglang"]) == 11


def test_custom_engine_sums_the_named_metrics() -> None:
    page = 'my_active 2\nmy_queued{q="a"} 3\nmy_queued{q="b"} 1\nother 9\n'
    assert in_flight(page, custom_engine("my_active, my_queued")) == 6


def test_missing_required_metric_is_an_error_not_a_zero() -> None:
    with pytest.raises(MetricsError) as caught:
        in_flight("# nothing here\nprocess_cpu_seconds_total 1.0\n", ENGINES["vllm"])
    assert caught.value.kind == "missing"
    assert "vllm:num_requests_running" in str(caught.value)


def test_absent_queue_metric_counts_zero() -> None:
    assert in_flight('vllm:num_requests_running{engine="0"} 2\n', ENGINES["vllm"]) == 2


def test_metric_whose_name_extends_another_is_not_counted() -> None:
    page = "vllm:num_requests_running_total 99\nvllm:num_requests_running 1\n"
    assert sum_samples(page, "vllm:num_requests_running") == 1


def test_help_and_type_lines_are_not_samples() -> None:
    page = "# HELP vllm:num_requests_running 7\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
    assert in_flight(page, ENGINES["vllm"]) == 0


def test_sample_on_the_first_line_is_read() -> None:
    assert sum_samples("tgi_queue_size 3\n", "tgi_queue_size") == 3


def test_label_values_with_braces_spaces_and_escapes_are_skipped_correctly() -> None:
    page = 'vllm:num_requests_running{model_name="a} b \\"c\\"",engine="0"} 4 1700000000000\n'
    assert in_flight(page, ENGINES["vllm"]) == 4


def test_windows_line_endings_and_tabs_are_accepted() -> None:
    assert sum_samples('x\t2\r\nx{a="1"}\t3\r\n', "x") == 5


@pytest.mark.parametrize(
    "line",
    [
        'vllm:num_requests_running{engine="0" 3',
        "vllm:num_requests_running abc",
        "vllm:num_requests_running NaN",
        "vllm:num_requests_running +Inf",
        "vllm:num_requests_running -1",
        "vllm:num_requests_running",
        "vllm:num_requests_running 1 2 3",
    ],
)
def test_malformed_samples_are_errors(line: str) -> None:
    with pytest.raises(MetricsError) as caught:
        in_flight(line + "\n", ENGINES["vllm"])
    assert caught.value.kind in {"malformed", "missing"}


def test_custom_engine_needs_a_metric_name() -> None:
    with pytest.raises(ValueError, match="at least one"):
        custom_engine(" , ")


@given(st.text())
def test_no_text_makes_a_reader_fail_other_than_with_metrics_error(page: str) -> None:
    for engine in ENGINES.values():
        try:
            value = in_flight(page, engine)
        except MetricsError:
            continue
        assert value >= 0


@given(st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=8), st.integers(0, 100))
def test_sum_over_label_sets_matches_the_values_written(values: list[int], waiting: int) -> None:
    lines = [f'vllm:num_requests_running{{engine="{i}",model_name="m"}} {v}.0' for i, v in enumerate(values)]
    lines.append(f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}')
    assert in_flight("\n".join(lines), ENGINES["vllm"]) == sum(values) + waiting


@pytest.mark.parametrize(
    "page",
    [
        'vllm:num_requests_running{engine="0",model_name="m"} 4 # {trace_id="abc"} 0 1700000000\n',
        'vllm:num_requests_running{engine="0",model_name="m"} 4 1700000000000 # {trace_id="abc"} 0\n',
        'vllm:num_requests_running 4 # {trace_id="abc"} 0 1700000000\n',
        'vllm:num_requests_running{model_name="a # {b} \\"c\\""} 4 # {trace_id="}"} 0\n',
    ],
)
def test_an_exemplar_is_never_read_as_the_samples_value(page: str) -> None:
    assert in_flight(page, ENGINES["vllm"]) == 4


def test_samples_that_add_up_past_a_float_are_malformed_not_an_overflow() -> None:
    page = 'vllm:num_requests_running{engine="0"} 1e308\nvllm:num_requests_running{engine="1"} 1e308\n'
    with pytest.raises(MetricsError) as caught:
        in_flight(page, ENGINES["vllm"])
    assert caught.value.kind == "malformed"


@given(st.binary(max_size=400))
def test_no_bytes_make_a_reader_fail_other_than_with_metrics_error(raw: bytes) -> None:
    page = raw.decode("utf-8", errors="replace")
    for engine in (*ENGINES.values(), custom_engine("vllm:num_requests_running,x")):
        try:
            assert read_engine(page, engine).in_flight >= 0
        except MetricsError:
            continue


@given(
    st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=5),
    st.lists(st.floats(min_value=0, max_value=1e6, allow_nan=False), min_size=5, max_size=5),
)
def test_exemplars_of_any_value_leave_the_sum_of_the_samples(values: list[int], exemplars: list[float]) -> None:
    lines = [
        f'vllm:num_requests_running{{engine="{i}"}} {v} # {{trace_id="t{i}"}} {exemplars[i]} 1700000000.5'
        for i, v in enumerate(values)
    ]
    assert in_flight("\n".join(lines), ENGINES["vllm"]) == sum(values)


# Lines of Ray 2.49.0's metrics agent page as it serves them (fewer labels): the node's own series, there from
# the agent's first export, Serve's proxy and replicas (an ingress's and an engine's), vLLM's under Ray.
RAY_NODE = """\
# HELP ray_node_mem_total Total memory on a ray node
# TYPE ray_node_mem_total gauge
ray_node_mem_total{IsHeadNode="false",RayNodeType="worker",Version="2.49.0",ip="10.0.3.7"} 2.5e+10
"""
RAY_SERVE = """\
# HELP ray_serve_num_ongoing_http_requests The number of ongoing requests in this HTTP Proxy.
# TYPE ray_serve_num_ongoing_http_requests gauge
ray_serve_num_ongoing_http_requests{Component="core_worker",WorkerId="83be",node_ip_address="10.0.3.7"} 2.0
# HELP ray_serve_replica_processing_queries The current number of queries being processed.
# TYPE ray_serve_replica_processing_queries gauge
ray_serve_replica_processing_queries{WorkerId="c914",application="llm",deployment="LLMServer:qwen",replica="j4ft"} 2.0
ray_serve_replica_processing_queries{WorkerId="d0a1",application="llm",deployment="OpenAiIngress",replica="x9k2"} 1.0
ray_vllm_num_requests_running{ReplicaId="j4ft",WorkerId="c914",engine="0",model_name="qwen-1.5b"} 2.0
"""


def test_ray_sums_what_this_nodes_serve_proxy_and_replicas_are_serving() -> None:
    assert read_engine(RAY_NODE + RAY_SERVE, ENGINES["ray"]).in_flight == 5


def test_on_rays_page_a_serve_series_not_recorded_yet_counts_zero() -> None:
    # A node whose proxy never had a request, or with no replica at all: Ray shows a series once it is recorded.
    replicas_only = RAY_NODE + 'ray_serve_replica_processing_queries{replica="j4ft"} 0.0\n'
    assert in_flight(replicas_only, ENGINES["ray"]) == 0
    assert in_flight(RAY_NODE, ENGINES["ray"]) == 0


def test_a_page_without_rays_node_series_is_no_zero_for_ray() -> None:
    # Not the agent's page, or the agent before its first export: its absent series say nothing.
    with pytest.raises(MetricsError) as caught:
        in_flight("process_cpu_seconds_total 1.0\n", ENGINES["ray"])
    assert caught.value.kind == "missing"
    with pytest.raises(MetricsError):
        in_flight(RAY_NODE, custom_engine("ray_vllm_num_requests_running"))


def test_ray_believes_a_zero_only_once_rays_default_export_could_have_shown_a_stream() -> None:
    # Each process harvests every half interval and sends every interval (10 s unless the pod's env says less):
    # a page can lag by 15 s, and a zero believed sooner could release a pod with streams not shown yet.
    assert ENGINES["ray"].zero_confirm_s >= 1.5 * 10.0
