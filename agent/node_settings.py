"""The node agent's settings: frozen, grouped, loaded once from flags and SPOTDRAIN_* variables."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from agent.cache.settings import CacheSettings, add_cache_arguments
from agent.cache.settings import from_arguments as cache_from_arguments
from spotdrain.settings import add_flag, add_kubeconfig_flag, add_switch, http_url, port, positive_int, require, seconds

# The Kubernetes API rate limit by mode, (calls per second, burst). In queue mode one Deployment marks and drains
# every node of the cluster, so it gets the limits of Karpenter, the controller that acts on the same interruptions
# for the whole cluster (KUBE_CLIENT_QPS 200, KUBE_CLIENT_BURST 300: aws/karpenter-provider-aws,
# website/content/en/preview/reference/settings.md). On a node the agent acts for that node alone, and a
# thousand such agents share one API server.
API_LIMITS = {"queue": (200.0, 300), "imds": (10.0, 20)}


@dataclass(frozen=True)
class ImdsSettings:
    url: str
    interval_s: float
    allow_v1: bool


@dataclass(frozen=True)
class SqsSettings:
    queue_url: str | None
    region: str | None
    endpoint_url: str | None
    max_receives: int
    wait_time_s: float
    max_in_flight: int


@dataclass(frozen=True)
class DrainSettings:
    evict: bool
    dry_run: bool
    margin_s: float
    eviction_delay_s: float
    heartbeat_s: float
    progress_timeout_s: float


@dataclass(frozen=True)
class KubeSettings:
    kubeconfig: str | None
    qps: float
    burst: int
    timeout_s: float


@dataclass(frozen=True)
class NodeSettings:
    node_name: str | None
    pod_name: str | None
    pod_namespace: str | None
    imds: ImdsSettings
    sqs: SqsSettings
    drain: DrainSettings
    kube: KubeSettings
    cache: CacheSettings
    host: str
    metrics_port: int
    notice_port: int
    check_interval_s: float  # 0: the installation checks are not run

    @property
    def queue_mode(self) -> bool:
        return self.sqs.queue_url is not None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--node-name", aliases=("NODE_NAME",), help="this node (IMDS mode; downward API spec.nodeName)")
    add_flag(parser, "--pod-name", aliases=("POD_NAME",), help="the agent's own pod, never evicted")
    add_flag(parser, "--pod-namespace", aliases=("POD_NAMESPACE",), help="the agent's own namespace")
    add_flag(parser, "--imds-url", convert=http_url, default="http://169.254.169.254", help="instance metadata URL")
    add_flag(parser, "--imds-interval", convert=seconds, default=1.0, help="seconds between IMDS polls")
    add_switch(parser, "--imds-v1", default=False, help="fall back to IMDSv1 when no IMDSv2 token can be had")
    add_flag(parser, "--queue-url", help="SQS queue of EventBridge events: queue mode instead of IMDS")
    add_flag(parser, "--aws-region", aliases=("AWS_REGION",), help="region of the queue")
    add_flag(parser, "--aws-endpoint-url", convert=http_url, help="SQS/Auto Scaling endpoint (tests, VPC endpoints)")
    add_flag(
        parser,
        "--max-receives",
        convert=positive_int,
        default=5,
        help="receives of a message for an unknown instance before it is dropped",
    )
    add_flag(parser, "--sqs-wait-time", convert=seconds, default=20.0, help="SQS long-polling wait, at most 20 s")
    add_flag(parser, "--sqs-max-in-flight", convert=positive_int, default=200, help="messages handled at once")
    add_kubeconfig_flag(parser)
    queue_qps, queue_burst = API_LIMITS["queue"]
    imds_qps, imds_burst = API_LIMITS["imds"]
    add_flag(
        parser,
        "--api-qps",
        convert=float,
        help="Kubernetes API calls per second",
        default_help=f"{queue_qps:g} in queue mode (Karpenter's), {imds_qps:g} in IMDS mode",
    )
    add_flag(
        parser,
        "--api-burst",
        convert=positive_int,
        help="Kubernetes API calls in a burst",
        default_help=f"{queue_burst} in queue mode (Karpenter's), {imds_burst} in IMDS mode",
    )
    add_flag(
        parser,
        "--api-timeout",
        convert=seconds,
        default=10.0,
        help="seconds a Kubernetes API call has for its whole answer, then it is retried on a new connection",
    )
    add_switch(parser, "--evict", default=True, help="evict the node's pods after tainting it")
    add_switch(parser, "--dry-run", default=False, help="log every change and make none")
    add_flag(
        parser,
        "--eviction-margin",
        convert=seconds,
        default=5.0,
        help="evicted pods' grace ends this long before the deadline",
    )
    add_flag(
        parser,
        "--eviction-delay",
        convert=seconds,
        default=1.0,
        help="seconds between publishing a notice and evicting",
    )
    add_flag(
        parser,
        "--heartbeat-interval",
        convert=seconds,
        default=10.0,
        help="seconds between SQS/ASG heartbeats during a drain",
    )
    add_flag(
        parser,
        "--progress-timeout",
        convert=seconds,
        default=60.0,
        help="/livez fails once a notice in hand has made no progress for this many seconds",
    )
    add_flag(parser, "--host", default="0.0.0.0", help="address for the metrics and notice endpoints")
    add_flag(parser, "--metrics-port", convert=port, default=8089, help="port for /metrics, /livez and /readyz")
    add_flag(parser, "--notice-port", convert=port, default=8090, help="port for GET /v1/notice")
    add_flag(
        parser,
        "--check-interval",
        convert=seconds,
        default=0.0,
        help="seconds between runs of spotdrain check's checks, exported as spotdrain_check_findings (0: never)",
    )
    add_cache_arguments(parser)


def from_arguments(args: argparse.Namespace) -> NodeSettings:
    """Build and validate the settings; raises SettingsError with the flag's name and the reason."""
    queue_mode = args.queue_url is not None
    require(queue_mode or bool(args.node_name), "IMDS mode needs --node-name (or NODE_NAME); queue mode --queue-url")
    require(not queue_mode or bool(args.aws_region), "--queue-url needs --aws-region (or AWS_REGION)")
    require(args.imds_interval > 0, "--imds-interval must be above 0 seconds")
    qps, burst = API_LIMITS["queue" if queue_mode else "imds"]
    qps = qps if args.api_qps is None else args.api_qps
    burst = burst if args.api_burst is None else args.api_burst
    require(qps > 0, "--api-qps must be above 0")
    require(args.sqs_wait_time <= 20, "--sqs-wait-time must be at most 20 seconds (the SQS limit)")
    require(args.heartbeat_interval > 0, "--heartbeat-interval must be above 0 seconds")
    require(args.api_timeout > 0, "--api-timeout must be above 0 seconds")
    require(args.progress_timeout > 0, "--progress-timeout must be above 0 seconds")
    # The pause before evicting makes no call: liveness must outlast it.
    require(args.progress_timeout > args.eviction_delay, "--progress-timeout must be longer than --eviction-delay")
    require(args.check_interval >= 0, "--check-interval must be 0 (never) or a number of seconds")
    return NodeSettings(
        node_name=args.node_name,
        pod_name=args.pod_name,
        pod_namespace=args.pod_namespace,
        imds=ImdsSettings(url=args.imds_url, interval_s=args.imds_interval, allow_v1=args.imds_v1),
        sqs=SqsSettings(
            queue_url=args.queue_url,
            region=args.aws_region,
            endpoint_url=args.aws_endpoint_url,
            max_receives=args.max_receives,
            wait_time_s=args.sqs_wait_time,
            max_in_flight=args.sqs_max_in_flight,
        ),
        drain=DrainSettings(
            evict=args.evict,
            dry_run=args.dry_run,
            margin_s=args.eviction_margin,
            eviction_delay_s=args.eviction_delay,
            heartbeat_s=args.heartbeat_interval,
            progress_timeout_s=args.progress_timeout,
        ),
        kube=KubeSettings(kubeconfig=args.kubeconfig, qps=qps, burst=burst, timeout_s=args.api_timeout),
        cache=cache_from_arguments(args),
        host=args.host,
        metrics_port=args.metrics_port,
        notice_port=args.notice_port,
        check_interval_s=args.check_interval,
    )
