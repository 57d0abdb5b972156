"""k8s/base/prometheusrule.yaml with Prometheus' own tools: `promtool check rules`, `promtool test rules`
(unit tests for every recording rule and alert in tests/promtool), and a real Prometheus server (Debian's
`prometheus`) that scrapes a real drafter and verifier on CPU during a short generation run, loads the rule
groups and then answers a non-zero acceptance rate from the recording rule. Every metric name in the rules
and the dashboard is checked against the live /metrics of both services."""

import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
from tools import require_tool

from specwire.commands.demo import free_port, start, stop, wait_drafter_connected, wait_serving
from specwire.v1 import generation_pb2 as pb
from specwire.v1 import generation_pb2_grpc

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the rules")

ROOT = Path(__file__).resolve().parents[1]
RULE = ROOT / "k8s" / "base" / "prometheusrule.yaml"
UNIT_TESTS = ROOT / "tests" / "promtool" / "specwire_rules_test.yaml"
DASHBOARD = ROOT / "k8s" / "base" / "grafana-dashboard.json"
INSTALL = "apt-get install prometheus (Debian; .ci/run installs it)"


def _groups(interval: str | None = None) -> list[dict]:
    groups = yaml.safe_load(RULE.read_text())["spec"]["groups"]
    if interval is not None:  # the real server evaluates every second instead of every 30 s
        groups = [{**g, "interval": interval} for g in groups]
    return groups


def _rule_file(directory: Path, interval: str | None = None) -> Path:
    path = directory / "specwire_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": _groups(interval)}, sort_keys=False))
    return path


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    promtool = require_tool("promtool", INSTALL)
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules(tmp_path):
    done = _promtool("check", "rules", str(_rule_file(tmp_path)), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in _groups())} rules found" in done.stdout


def test_promtool_unit_tests_cover_every_rule(tmp_path):
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    _rule_file(tmp_path)
    done = _promtool("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    tested = {t["expr"] for case in tests for t in case.get("promql_expr_test", [])}
    alerted = {t["alertname"] for case in tests for t in case.get("alert_rule_test", []) if t["exp_alerts"]}
    rules = [r for g in _groups() for r in g["rules"]]
    assert {r["record"] for r in rules if "record" in r} <= tested
    assert {r["alert"] for r in rules if "alert" in r} <= alerted  # each alert is shown firing


def test_promtool_unit_tests_can_fail(tmp_path):
    """A wrong expectation fails `promtool test rules`: the suite above is not vacuous."""
    broken = UNIT_TESTS.read_text().replace("value: 0.25}]", "value: 0.3}]", 1)
    assert broken != UNIT_TESTS.read_text()
    (tmp_path / UNIT_TESTS.name).write_text(broken)
    _rule_file(tmp_path)
    done = _promtool("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr


# ---------------------------------------------------------------- a real Prometheus and real services


def _get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def _api(port: int, path: str, **params) -> dict:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    body = json.loads(_get(f"http://127.0.0.1:{port}/api/v1/{path}{query}"))
    assert body["status"] == "success", body
    return body["data"]


def _poll(what: str, fn, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def services():
    """A real `specwire drafter` and `specwire verifier` (default model, shipped head, CPU) with /metrics."""
    log_dir = Path(tempfile.mkdtemp(prefix="specwire-prometheus-"))
    metrics = {"drafter": free_port(), "verifier": free_port()}
    drafter = start("drafter", ["drafter", "--device", "cpu", "--metrics-port", str(metrics["drafter"])],
                    log_dir)
    verifier = start("verifier", ["verifier", "--device", "cpu", "--k", "3",
                                  "--metrics-port", str(metrics["verifier"]),
                                  "--drafter", f"127.0.0.1:{drafter.port}"], log_dir)
    try:
        wait_serving([drafter, verifier], timeout=180)
        assert wait_drafter_connected(verifier.port, 60), "the verifier never connected to the drafter"
        yield {"grpc": verifier.port, "metrics": metrics, "log_dir": log_dir}
    finally:
        stop([verifier, drafter])
        shutil.rmtree(log_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def prometheus(services):
    binary = require_tool("prometheus", INSTALL)
    directory = Path(tempfile.mkdtemp(prefix="specwire-prometheus-server-"))
    rules = _rule_file(directory, interval="1s")
    targets = [f"127.0.0.1:{p}" for p in services["metrics"].values()]
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(rules)],
              "scrape_configs": [{"job_name": "specwire", "static_configs": [{"targets": targets}]}]}
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with open(directory / "prometheus.log", "w") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={directory / 'prometheus.yml'}",
             f"--storage.tsdb.path={directory / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        def ready() -> bool:
            assert process.poll() is None, (directory / "prometheus.log").read_text()[-2000:]
            try:
                return _get(f"http://127.0.0.1:{port}/-/ready").strip() != ""
            except OSError:
                return False

        _poll("Prometheus to start", ready)
        yield port
    finally:
        process.terminate()
        process.wait(30)
        shutil.rmtree(directory, ignore_errors=True)


def _generate(port: int, prompt: str, max_tokens: int) -> pb.Complete:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        sampling = pb.SamplingParams(max_tokens=max_tokens)
        request = pb.GenerateRequest(text=prompt, chat=True, sampling=sampling)
        responses = list(stub.Generate(request, timeout=120))
    assert responses[-1].WhichOneof("event") == "complete", responses[-1]
    return responses[-1].complete


def test_real_prometheus_records_the_acceptance_rate(services, prometheus):
    # Both targets are up and scraped before any token is drafted, so rate() sees the counters rise.
    def both_up() -> bool:
        active = _api(prometheus, "targets")["activeTargets"]
        return len(active) == 2 and all(t["health"] == "up" for t in active)

    _poll("both targets up", both_up)
    groups = _api(prometheus, "rules")["groups"]
    assert {g["name"] for g in groups} == {g["name"] for g in _groups()}
    assert all(r["health"] != "err" for g in groups for r in g["rules"]), groups
    usage = [_generate(services["grpc"], p, 24).usage for p in ("Name three colours.", "Count to five.")]
    assert sum(u.accepted_tokens for u in usage) > 0, usage  # the drafter's tokens were accepted

    def acceptance() -> float:
        result = _api(prometheus, "query", query="specwire:spec_decode_acceptance_rate:rate5m")["result"]
        return float(result[0]["value"][1]) if result and result[0]["value"][1] != "NaN" else 0.0

    rate = _poll("a non-zero recorded acceptance rate", acceptance)
    assert 0 < rate <= 1
    length = _api(prometheus, "query", query="specwire:spec_decode_mean_acceptance_length:rate5m")["result"]
    assert float(length[0]["value"][1]) > 1


def _live_names(port: int) -> set[str]:
    body = _get(f"http://127.0.0.1:{port}/metrics")
    lines = [line for line in body.splitlines() if line and not line.startswith("#")]
    return {line.split("{")[0].split(" ")[0] for line in lines}


def test_every_expression_names_a_live_metric(services, prometheus):
    """Names in the rules and the dashboard against what both services export right now (after the run
    above, so labelled series such as per-position acceptance exist)."""
    live = set().union(*(_live_names(p) for p in services["metrics"].values()))
    assert not {n for n in live if n.endswith("_created")}
    rules = [r for g in _groups() for r in g["rules"]]
    recorded = {r["record"] for r in rules if "record" in r}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [r["expr"] for r in rules] + [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    raw = {n for e in exprs for n in re.findall(r"\bspecwire_\w+", e)}
    named_recorded = {n for e in exprs for n in re.findall(r"\bspecwire:[\w:]+", e)}
    assert raw and raw <= live, f"not exported by either live service: {sorted(raw - live)}"
    assert named_recorded <= recorded
