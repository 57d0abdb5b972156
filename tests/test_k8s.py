"""k8s/ manifests parse and hang together; the dashboard queries only metrics specwire exports."""

import json
import re
from pathlib import Path

import pytest

from specwire.metrics import DrafterMetrics, VerifierMetrics

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to parse the manifests")

K8S = Path(__file__).resolve().parents[1] / "k8s"


def _docs() -> list[dict]:
    return [doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def _by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in _docs() if d["kind"] == kind}


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests
    for generator in kustomization["configMapGenerator"]:
        for name in generator["files"]:
            assert (K8S / name).is_file()


@pytest.mark.parametrize(("name", "service"), [("specwire-drafter", "specwire.v1.Drafter"),
                                               ("specwire-verifier", "specwire.v1.Generation")])
def test_deployments_wire_up(name, service):
    deployment = _by_kind("Deployment")[name]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
    assert str(ports["metrics"]) in container["args"]
    health_listen = container["args"][container["args"].index("--health-listen") + 1]
    assert health_listen.endswith(f":{ports['health']}")
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["grpc"] == {"port": ports["health"], "service": service}
    # Grace: the pod must outlive the drain it asks the service for.
    config = _by_kind("ConfigMap")["specwire-config"]["data"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > float(config["SPECWIRE_GRACE_SECONDS"])
    # Every $(VAR) in args comes from the ConfigMap or the container's env.
    env = set(config) | {e["name"] for e in container.get("env", [])}
    assert set(re.findall(r"\$\((\w+)\)", " ".join(container["args"]))) <= env
    # Every mounted volume exists and the TLS paths point into a mount.
    volumes = {v["name"] for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"] for m in container["volumeMounts"] if m["name"] in volumes}
    tls_paths = [e["value"] for e in container["env"] if e["name"].endswith(("TLS_CERT", "TLS_KEY", "_CA"))]
    assert tls_paths and all(any(p.startswith(m + "/") for m in mounts) for p in tls_paths)
    service_ports = {p["name"]: p["targetPort"] for p in _by_kind("Service")[name]["spec"]["ports"]}
    assert set(service_ports.values()) <= set(ports)


def test_service_monitor_selects_the_metrics_ports():
    monitor = _by_kind("ServiceMonitor")["specwire"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    for service in _by_kind("Service").values():
        assert selector.items() <= service["metadata"]["labels"].items()
        assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"


def test_dashboard_queries_exported_metrics():
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum")}
    exported = {family.name + suffix for metrics in (VerifierMetrics(), DrafterMetrics())
                for family in metrics.registry.collect() for suffix in suffixes[family.type]}
    dashboard = json.loads((K8S / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\bspecwire_\w+", expr)}
    assert used and used <= exported, f"not exported: {sorted(used - exported)}"
    assert any("num_accepted_tokens_total" in e and "num_draft_tokens_total" in e for e in exprs)
