"""``spotdrain check`` on what is about to go wrong, and within ``--namespace``: a budget that blocks evictions once
the webhook injects the sidecar it missed, and findings about other namespaces left out of a narrowed report. Each
test runs on the fake API server, then on the real kube-apiserver (the ``api`` fixture of ``test_check``)."""

from __future__ import annotations

from check.reading import Scope
from tests.integration.check_cluster import clean_install, engine
from tests.integration.test_check import Api, api, only, problems, report

__all__ = ["api"]  # the fixture, shared with test_check


async def test_a_budget_over_pods_still_awaiting_the_sidecar_is_an_error_before_it_blocks_evictions(api: Api) -> None:
    await clean_install(api.build)
    # Created while the webhook did not answer (failurePolicy: Ignore): no sidecar yet, in a labelled namespace.
    await api.build.pod("inference", "llama-0", node="gpu-1", containers=[engine()], labels={"app": "llama"})
    await api.build.create(
        "PodDisruptionBudget",
        "llama",
        namespace="inference",
        spec={"maxUnavailable": 1, "selector": {"matchLabels": {"app": "llama"}}},
    )
    found = await report(api)
    assert sorted(f.check for f in problems(found)) == ["budgets", "sidecar-injection"]
    budget = next(f for f in problems(found) if f.check == "budgets")
    assert budget.severity == "error"
    assert budget.objects == ("PodDisruptionBudget/inference/llama",)
    assert "covers 1 pods that get the sidecar once recreated and lacks unhealthyPodEvictionPolicy" in budget.message


async def test_a_budget_over_gpu_pods_of_a_namespace_that_does_not_ask_for_the_sidecar_is_not_judged(
    api: Api,
) -> None:
    await clean_install(api.build)
    await api.build.namespace("research")
    await api.build.pod("research", "llama-0", node="gpu-1", containers=[engine()], labels={"app": "llama"})
    await api.build.create(
        "PodDisruptionBudget",
        "llama",
        namespace="research",
        spec={"maxUnavailable": 1, "selector": {"matchLabels": {"app": "llama"}}},
    )
    assert only(await report(api), "sidecar-injection").objects == ("Namespace/research", "Pod/research/llama-0")


async def test_a_narrowed_report_says_nothing_of_a_labelled_namespace_outside_it(api: Api) -> None:
    await api.build.namespace("inference", inject=True)
    await api.build.namespace("research")
    webhook = next(f for f in (await report(api)).findings if f.check == "webhook")
    assert (webhook.severity, webhook.objects) == ("error", ("Namespace/inference",))
    assert webhook.message == "namespaces inference are labelled spotdrain.io/inject=true but no webhook is installed"
    narrowed = next(f for f in (await report(api, Scope(namespace="research"))).findings if f.check == "webhook")
    assert narrowed.severity == "ok"
    inside = next(f for f in (await report(api, Scope(namespace="inference"))).findings if f.check == "webhook")
    assert (inside.severity, inside.objects) == ("error", ("Namespace/inference",))
