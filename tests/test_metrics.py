"""specwire.metrics scraped over real HTTP and parsed with Prometheus' own parser."""

import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specwire.metrics import DrafterMetrics, VerifierMetrics


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


@pytest.fixture
def verifier():
    metrics = VerifierMetrics()
    port = metrics.serve(0, addr="127.0.0.1")
    yield metrics, port
    metrics.close()


def test_verifier_metrics_scrape(verifier):
    metrics, port = verifier
    # Two steps: requests with 4 drafts accepting 3 and 0, one request with no drafts, then 2 drafts accept 2.
    metrics.observe_verification([4, 4, 0], [3, 0, 0])
    metrics.observe_verification([2], [2])
    metrics.time_to_first_token.observe(0.03)
    metrics.inter_token_latency.observe(0.0015)
    metrics.inter_token_latency.observe(3.0)
    metrics.num_requests_running.set(5)
    metrics.fallback_steps.labels(reason="timeout").inc()
    metrics.drafter_rpc_bytes.labels(direction="sent").inc(1234)
    m = _scrape(port)
    assert m[("specwire_spec_decode_num_drafts_total", ())] == 3
    assert m[("specwire_spec_decode_num_draft_tokens_total", ())] == 10
    assert m[("specwire_spec_decode_num_accepted_tokens_total", ())] == 5
    per_pos = {pos: m[("specwire_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(pos)),))]
               for pos in range(4)}
    assert per_pos == {0: 2, 1: 2, 2: 1, 3: 0}  # positions up to the longest drafted, accepted or not
    drafted = {pos: m[("specwire_spec_decode_num_draft_tokens_per_pos_total", (("position", str(pos)),))]
               for pos in range(4)}
    assert drafted == {0: 3, 1: 3, 2: 2, 3: 2}
    assert ("specwire_spec_decode_num_accepted_tokens_per_pos_total", (("position", "4"),)) not in m
    assert m[("specwire_time_to_first_token_seconds_bucket", (("le", "0.04"),))] == 1
    assert m[("specwire_time_to_first_token_seconds_bucket", (("le", "0.02"),))] == 0
    assert m[("specwire_inter_token_latency_seconds_bucket", (("le", "0.002"),))] == 1
    assert m[("specwire_inter_token_latency_seconds_bucket", (("le", "2.0"),))] == 1
    assert m[("specwire_inter_token_latency_seconds_bucket", (("le", "+Inf"),))] == 2
    assert m[("specwire_num_requests_running", ())] == 5
    assert m[("specwire_fallback_steps_total", (("reason", "timeout"),))] == 1
    # Every label value exists from the start, at 0, so rate() queries work before the first event.
    assert m[("specwire_fallback_steps_total", (("reason", "down"),))] == 0
    assert m[("specwire_forward_steps_total", (("mode", "cuda_graph"),))] == 0
    assert m[("specwire_drafter_rpc_bytes_total", (("direction", "sent"),))] == 1234
    assert m[("specwire_bad_payloads_total", (("reason", "unknown_request"),))] == 0


def test_verification_counts_are_checked(verifier):
    metrics, _ = verifier
    with pytest.raises(ValueError, match="accepted 5 draft tokens out of 4"):
        metrics.observe_verification([4], [5])
    with pytest.raises(ValueError):
        metrics.observe_verification([4, 4], [1])


def test_registries_are_per_instance():
    """Two services (or two test servers) in one process must not share or clash on metrics."""
    drafter_a, drafter_b = DrafterMetrics(), DrafterMetrics()
    port = drafter_a.serve(0, addr="127.0.0.1")
    try:
        drafter_a.draft_step_time.observe(0.0004)
        drafter_a.forward_steps.labels(mode="cuda_graph").inc(3)
        drafter_b.forward_steps.labels(mode="cuda_graph").inc(100)
        m = _scrape(port)
        assert m[("specwire_forward_steps_total", (("mode", "cuda_graph"),))] == 3
        assert m[("specwire_drafter_step_seconds_bucket", (("le", "0.0005"),))] == 1
        assert m[("specwire_drafter_step_seconds_count", ())] == 1
        assert not any(name.startswith("specwire_spec_decode") for name, _ in m)
    finally:
        drafter_a.close()


# ---------------------------------------------------------------- hygiene: one documented table, no _created

OPERATIONS = Path(__file__).resolve().parents[1] / "docs" / "OPERATIONS.md"
# The labels a metric may carry: each takes a handful of fixed values (positions up to k), never an id.
# "result" is for the speculation cache's hit / miss / late lookups.
BOUNDED_LABELS = {"mode", "direction", "reason", "finish_reason", "position", "code", "state", "result",
                  "waiting_for"}


def _documented() -> dict[str, tuple[str, set[str], str]]:
    """The metrics table of docs/OPERATIONS.md: name -> (type, label names, service)."""
    section = OPERATIONS.read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`specwire_"):
            labels = set(re.findall(r"`(\w+)`:", cells[2]))
            rows[cells[0].strip("`")] = (cells[1], labels, cells[3])
    return rows


def _exported() -> dict[str, tuple[str, set[str], str]]:
    """What the two registries hold, named as the table names them."""
    found: dict[str, tuple[str, set[str], set[str]]] = {}
    for service, metrics in (("verifier", VerifierMetrics()), ("drafter", DrafterMetrics())):
        for collector in metrics.registry._collector_to_names:
            family = collector.describe()[0]
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = set(collector._labelnames)
            kind, _, services = found.setdefault(name, (family.type, labels, set()))
            services.add(service)
    return {name: (kind, labels, "both" if len(services) == 2 else services.pop())
            for name, (kind, labels, services) in found.items()}


def test_every_metric_is_documented_in_one_table():
    documented, exported = _documented(), _exported()
    assert sorted(documented) == sorted(exported), "docs/OPERATIONS.md's table differs from specwire.metrics"
    for name, (kind, labels, service) in exported.items():
        assert documented[name] == (kind, labels, service), name
    assert list(documented) == sorted(documented), "keep the table sorted by metric name"


def test_labels_are_low_cardinality():
    for name, (_kind, labels, _service) in _exported().items():
        assert labels <= BOUNDED_LABELS, f"{name} has an unbounded label: {labels - BOUNDED_LABELS}"


def test_no_created_series(verifier):
    metrics, port = verifier
    metrics.observe_verification([4], [2])
    metrics.time_to_first_token.observe(0.03)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "specwire_spec_decode_num_drafts_total 1.0" in body
    assert "_created" not in body
