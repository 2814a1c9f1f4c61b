"""The eviction guard's decision: an agent's token bound to a node may evict only pods bound to that node."""

from __future__ import annotations

from typing import Any

from spotdrain.retry import ApiError
from webhook.eviction_guard import NODE_NAME, judge, token_node, verdict

Obj = dict[str, Any]


def request(*, extra: Obj | None = None) -> Obj:
    user = {"username": "system:serviceaccount:spotdrain:spotdrain-node"} | ({"extra": extra} if extra else {})
    return {"uid": "u-1", "namespace": "ml", "name": "vllm-0", "userInfo": user}


def pod_on(node: str | None) -> Obj:
    return {"metadata": {"name": "vllm-0", "namespace": "ml"}, "spec": {"nodeName": node} if node else {}}


def test_the_node_comes_from_the_tokens_extra_only() -> None:
    assert token_node(request(extra={NODE_NAME: ["gpu-a"]})) == "gpu-a"
    assert token_node(request()) is None
    assert token_node(request(extra={NODE_NAME: []})) is None
    assert token_node(request(extra={NODE_NAME: ["gpu-a", "gpu-b"]})) is None  # not one node: none
    assert token_node(request(extra={NODE_NAME: "gpu-a"})) is None  # not the list the API server sends


def test_a_pod_on_the_tokens_node_may_be_evicted_and_one_elsewhere_may_not() -> None:
    bound = request(extra={NODE_NAME: ["gpu-a"]})
    assert verdict(bound, pod_on("gpu-a")) == (True, "")
    allowed, message = verdict(bound, pod_on("gpu-b"))
    assert not allowed
    assert message == "spotdrain-node on gpu-a may evict only pods bound to gpu-a; ml/vllm-0 is on gpu-b"
    assert verdict(bound, pod_on(None))[0] is False  # a pod not yet scheduled is on no agent's node
    assert verdict(bound, None) == (True, "")  # no such pod: the API server answers 404 itself


def test_a_token_bound_to_no_node_evicts_nothing() -> None:
    allowed, message = verdict(request(), pod_on("gpu-a"))
    assert not allowed
    assert "token bound to its pod on a node" in message


async def test_a_lookup_that_fails_denies_and_says_why() -> None:
    async def failing(namespace: str, name: str) -> Obj | None:
        raise ApiError(503, "etcd is down")

    answer = await judge(request(extra={NODE_NAME: ["gpu-a"]}), failing)
    response = answer["response"]
    assert (response["uid"], response["allowed"], response["status"]["code"]) == ("u-1", False, 403)
    assert "could not read pod ml/vllm-0" in response["status"]["message"]


async def test_without_api_access_every_eviction_is_denied() -> None:
    answer = await judge(request(extra={NODE_NAME: ["gpu-a"]}), None)
    assert answer["response"]["allowed"] is False
    assert answer["response"]["status"]["message"] == "the guard has no API access"


async def test_an_eviction_by_any_other_account_is_never_judged() -> None:
    for user in ("system:serviceaccount:karpenter:karpenter", "kubernetes-admin", "system:serviceaccount:x:spotdrain"):
        other = request() | {"userInfo": {"username": user}}
        assert verdict(other, pod_on("gpu-b")) == (True, "")
        assert (await judge(other, None))["response"]["allowed"] is True
