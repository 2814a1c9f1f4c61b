"""The containers of the rendered manifests that run a spotdrain image, and the ``podman run`` options that run it
the way the kubelet would: the manifest's command and args, user, read-only root filesystem, capabilities and
environment.

What the kubelet does that podman does not by default, and where it is documented:
- ``command`` replaces the image's ENTRYPOINT and ``args`` its CMD (Kubernetes, "Define a Command and Arguments for
  a Container": "If you supply a command but no args, only the supplied command is used").
- ``readOnlyRootFilesystem`` makes the root read-only and mounts nothing writable in its place; podman's
  ``--read-only`` adds tmpfs on /tmp, /var/tmp and /run unless ``--read-only-tmpfs=false`` (podman-run(1)).
- ``runAsNonRoot`` without ``runAsUser`` refuses an image whose user is root or not numeric (kubelet's
  ``verifyRunAsNonRoot``, pkg/kubelet/kuberuntime/security_context_others.go).
- Every container gets ``KUBERNETES_SERVICE_HOST``/``_PORT`` (the API server's Service), enableServiceLinks or not
  (pkg/kubelet/kubelet_pods.go, ``getServiceEnvVarMap``); here they name a port nothing listens on in the
  container's network: a cluster whose API cannot be reached.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.deploy.manifests import Invocation, Obj, PodTemplate, invocation, pod_templates, render, renderings
from tests.install.engine import program_of

UNREACHABLE_API = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "9"}


@dataclass(frozen=True)
class Container:
    """One container of a rendered manifest that runs a spotdrain image."""

    rendering: str
    template: PodTemplate
    spec: Obj
    call: Invocation  # the command line with $(VAR) expanded, and the environment the manifest sets

    @property
    def program(self) -> str:
        program = program_of(self.spec["image"])
        assert program is not None
        return program

    @property
    def where(self) -> str:
        return f"{self.rendering}: {self.template.name} container {self.spec['name']}"

    @property
    def command(self) -> list[str]:
        command: list[str] = self.spec.get("command") or []
        return command

    @property
    def args(self) -> list[str]:
        return self.call.argv[len(self.command) - 1 :]

    @property
    def security(self) -> dict[str, Any]:
        """The pod's securityContext with the container's own over it (the container's fields win)."""
        return {**(self.template.spec.get("securityContext") or {}), **(self.spec.get("securityContext") or {})}


def spotdrain_containers(renderings_: list[str] | None = None) -> Iterator[Container]:
    """Every container, init containers included, of every rendering a user may install, that runs an image one of
    the Dockerfiles builds."""
    for what in renderings() if renderings_ is None else renderings_:
        objects = render(what)
        for template in pod_templates(objects):
            for spec in template.spec.get("initContainers", []) + template.containers:
                call = invocation(template.name, spec, objects)
                if program_of(spec.get("image", "")) is not None:
                    assert call is not None, f"{what}: {template.name} runs {spec['image']} without `spotdrain`"
                    yield Container(what, template, spec, call)


def user_options(container: Container, image_user: str) -> list[str]:
    """``--user`` as the kubelet would run the container; AssertionError where the kubelet would refuse it."""
    security = container.security
    uid, gid = security.get("runAsUser"), security.get("runAsGroup")
    image_uid = image_user.partition(":")[0] or "0"
    if security.get("runAsNonRoot") and uid is None:
        assert image_uid.isdigit(), f"{container.where}: runAsNonRoot, and the image's user {image_user!r} is no uid"
        assert image_uid != "0", f"{container.where}: runAsNonRoot, and the image runs as root"
    if security.get("runAsNonRoot"):
        assert uid != 0, f"{container.where}: runAsNonRoot with runAsUser 0"
    if uid is None and gid is None:
        return []
    return ["--user", f"{image_uid if uid is None else uid}" + ("" if gid is None else f":{gid}")]


def run_options(container: Container, image_user: str, *, volumes: Mapping[str, Path] | None = None) -> list[str]:
    """The container's user, root filesystem, capabilities, environment, command and volumes as podman options.

    An emptyDir becomes a tmpfs; the other volumes are mounted only where ``volumes`` gives a host directory for
    them (a Secret's files, say), and left out otherwise."""
    security = container.security
    options = user_options(container, image_user)
    if security.get("readOnlyRootFilesystem"):
        options += ["--read-only", "--read-only-tmpfs=false"]
    capabilities = security.get("capabilities") or {}
    options += [f"--cap-drop={cap}" for cap in capabilities.get("drop", [])]
    options += [f"--cap-add={cap}" for cap in capabilities.get("add", [])]
    if security.get("allowPrivilegeEscalation") is False:
        options += ["--security-opt=no-new-privileges"]
    for name, value in {**UNREACHABLE_API, **container.call.env}.items():
        options += ["--env", f"{name}={value}"]
    options += ["--entrypoint", json.dumps(container.command)]
    return options + _volume_options(container, volumes or {})


def _volume_options(container: Container, given: Mapping[str, Path]) -> list[str]:
    options = []
    for mount in container.spec.get("volumeMounts", []):
        volume = container.template.volume(mount["name"])
        if "emptyDir" in volume:
            options += ["--tmpfs", f"{mount['mountPath']}:mode=1777"]
        elif mount["name"] in given:
            options += ["-v", f"{given[mount['name']]}:{mount['mountPath']}:ro"]
    return options


def probe_ports(container: Container) -> list[int]:
    """The container's ports, to publish on 127.0.0.1."""
    return [int(port["containerPort"]) for port in container.spec.get("ports", [])]
