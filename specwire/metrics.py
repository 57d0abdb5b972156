"""Prometheus metrics of the two services, each in its own registry, served over HTTP on --metrics-port.

Speculation counters keep vLLM's meaning so its dashboards and queries carry over: acceptance rate is
rate(num_accepted_tokens) / rate(num_draft_tokens), mean acceptance length 1 + rate(accepted) / rate(drafts).
Labels are low-cardinality enums only (never request ids). Every metric is documented in one table,
docs/OPERATIONS.md#metrics, which a test keeps equal to what the registries hold.
"""

from collections.abc import Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# No `<counter>_created` series: they double every counter in /metrics and no query of ours reads them.
prometheus_client.disable_created_metrics()

PREFIX = "specwire"

# Bucket edges in seconds, each spanning what its latency does from a fast GPU to an overloaded one.
TTFT_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
)
ITL_BUCKETS = (
    0.001,
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
# An RPC round trip or a draft step: 0.1 ms (loopback, tiny batch) to 1 s (a stalled peer).
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)

FALLBACK_REASONS = ("down", "timeout", "bad_payload")
IDLE_CAUSES = ("launch", "drafts")  # what a verifier's device waited for before a verification
FINISH_REASONS = ("stop", "length", "abort", "error")
STEP_MODES = ("cuda_graph", "eager")
LOOKUP_RESULTS = ("hit", "miss", "late", "unasked")
JUST_IN_TIME_RESULTS = ("drafted", "undrafted", "late", "declined")
DRAFTING_MODES = ("tables", "serial", "none")
BAD_PAYLOAD_REASONS = ("bad_tensor", "unknown_request", "probs_mismatch", "link_error")
DIRECTIONS = ("sent", "received")
# Requests refused before they were queued, by the google.rpc code of their in-band Error.
REJECT_CODES = ("invalid_argument", "already_exists", "resource_exhausted", "unavailable", "internal")


class _ServiceMetrics:
    """What both services count: forward steps by mode, bytes on the drafter link, payloads refused."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._http = None
        self.forward_steps = self._counter(
            "forward_steps", "Model forward steps, replayed from a CUDA graph or run eagerly.", ["mode"]
        )
        self.drafter_rpc_bytes = self._counter(
            "drafter_rpc_bytes", "Serialized bytes of Draft stream messages.", ["direction"]
        )
        self.bad_payloads = self._counter(
            "bad_payloads",
            "Drafter-link messages (or parts) refused: malformed tensor, unknown request id, "
            "probabilities that do not match their kind, or an unexpected error on the link (link_error).",
            ["reason"],
        )
        # Every label value exists from the start, so rate() sees a 0 before the first event instead of no
        # series. Per-step paths use these pre-bound children: labels() locks and builds a key every call.
        self.forward_steps_by_mode = {mode: self.forward_steps.labels(mode=mode) for mode in STEP_MODES}
        self.rpc_bytes = {d: self.drafter_rpc_bytes.labels(direction=d) for d in DIRECTIONS}
        for reason in BAD_PAYLOAD_REASONS:
            self.bad_payloads.labels(reason=reason)

    def _counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(f"{PREFIX}_{name}", doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()
                   ) -> Histogram:
        return Histogram(f"{PREFIX}_{name}", doc, labels, buckets=buckets, registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(f"{PREFIX}_{name}", doc, labels, registry=self.registry)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serves /metrics on a daemon thread; returns the bound port (`port` 0 picks a free one)."""
        if self._http is not None:
            raise RuntimeError("metrics already served")
        self._http, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return self._http.server_address[1]

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class VerifierMetrics(_ServiceMetrics):
    def __init__(self) -> None:
        super().__init__()
        c, h, g = self._counter, self._histogram, self._gauge
        self.num_drafts = c(
            "spec_decode_num_drafts", "Verification rounds of a request with >= 1 draft token."
        )
        self.num_draft_tokens = c("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = c("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.num_accepted_tokens_per_pos = c(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0-based).",
            ["position"],
        )
        self.num_draft_tokens_per_pos = c(
            "spec_decode_num_draft_tokens_per_pos",
            "Draft tokens verified at each draft position (0-based), per-position acceptance's denominator.",
            ["position"],
        )
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens prefilled.")
        self.prompts_carried = c(
            "prompts_carried",
            "Prompts prefilled inside a verification's forward (--carry-rows) rather than by a prefill step.")
        self.generation_tokens = c("generation_tokens", "Tokens generated.")
        self.verified_rows = c(
            "verified_rows",
            "Requests verified, summed over verifications (carried prompts not included): over "
            "verify_step_seconds' count, the batch a verification ran at.")
        self.requests_finished = c(
            "requests_finished", "Finished requests by finish reason.", ["finish_reason"]
        )
        for reason in FINISH_REASONS:
            self.requests_finished.labels(finish_reason=reason)
        self.time_to_first_token = h(
            "time_to_first_token_seconds", "Request arrival to first token.", TTFT_BUCKETS
        )
        self.inter_token_latency = h(
            "inter_token_latency_seconds", "Time between a request's output tokens.", ITL_BUCKETS
        )
        self.stream_outputs_joined = c(
            "stream_outputs_joined",
            "Outputs of a request sent in the chunk of an earlier one: its stream had fallen behind (the "
            "verifier's loop busy with rounds) and caught up in one write.",
        )
        self.e2e_request_latency = h(
            "e2e_request_latency_seconds", "Request arrival to last token.", E2E_BUCKETS
        )
        self.num_requests_running = g("num_requests_running", "Requests in the decode batch.")
        self.num_requests_waiting = g("num_requests_waiting", "Requests queued for a slot.")
        self.drafter_features_shared = g(
            "drafter_features_shared",
            "1 while the drafter's stream takes the target features as rows of this verifier's table in GPU "
            "memory (CUDA IPC, a drafter on this host), 0 while they travel as bytes or no drafter is "
            "connected.")
        self.drafter_rpc_latency = h(
            "drafter_rpc_latency_seconds", "DraftStep sent to its DraftResult received.", STEP_BUCKETS
        )
        self.verify_step_time = h(
            "verify_step_seconds", "Engine-thread time of one verification (forward, sampling, readback; one "
            "launched ahead: its forward's launch, then from its sampler's launch to its tokens).",
            STEP_BUCKETS,
        )
        self.verify_gpu_time = h(
            "verify_gpu_seconds",
            "Device time of one verification's forward and sampler, from CUDA events (CUDA only): unlike "
            "verify_step_seconds, without the device's wait for work queued before it (drafts); with any "
            "idle time while the host launches it.",
            STEP_BUCKETS,
        )
        self.verify_gpu_idle = h(
            "verify_gpu_idle_seconds",
            "Device time idle before a verification, since the last one's sampler, when nothing else ran "
            "between them (CUDA only; not with a co-located drafter), by what it waited for: launch (the "
            "round not yet queued: the host's own work, or the host waiting for a drafter's answer) or "
            "drafts (queued behind drafts a drafter process writes on this GPU).",
            STEP_BUCKETS, ["waiting_for"],
        )
        self.gpu_idle = {cause: self.verify_gpu_idle.labels(waiting_for=cause) for cause in IDLE_CAUSES}
        self.prefill_step_time = h(
            "prefill_step_seconds",
            "Engine-thread time of one prefill step (forward, sampling, the features' hand-off); its count "
            "is the prefill steps, one per admission of waiting requests.",
            STEP_BUCKETS,
        )
        self.fallback_steps = c(
            "fallback_steps", "Steps decoded without drafts because of a drafter fault.", ["reason"]
        )
        self.fallbacks = {reason: self.fallback_steps.labels(reason=reason) for reason in FALLBACK_REASONS}
        self.spec_cache_lookups = c(
            "spec_cache_lookups",
            "Speculation-cache lookups after a verification, per request: hit (drafts ready), miss (outcome "
            "not in the table), late (the table did not come in time), unasked (no table was asked for: the "
            "drafter link at its in-flight limit, or the request at its end).",
            ["result"],
        )
        self.cache = {r: self.spec_cache_lookups.labels(result=r) for r in LOOKUP_RESULTS}
        self.spec_cache_just_in_time = c(
            "spec_cache_just_in_time",
            "Requests a round found without table drafts, by what the drafts made just in time for them came "
            "to: drafted, undrafted (the drafter had none), late (not within the wait), declined (waiting "
            "would not pay, or the drafter link was busy).",
            ["result"],
        )
        self.just_in_time = {r: self.spec_cache_just_in_time.labels(result=r) for r in JUST_IN_TIME_RESULTS}
        self.spec_cache_rounds = c(
            "spec_cache_rounds",
            "Rounds of a speculation-cache verifier by how their drafts came: tables (drafted while the "
            "round before verified), serial (an adaptive verifier's serial epochs) or none (its epochs "
            "without drafts, kept where speculation does not pay).",
            ["mode"],
        )
        self.drafting_rounds = {m: self.spec_cache_rounds.labels(mode=m) for m in DRAFTING_MODES}
        self.spec_cache_round_seconds = c(
            "spec_cache_round_seconds",
            "Those rounds' time by mode, each from its start (waits for its drafts included) to its tokens: "
            "over spec_cache_rounds, a mode's mean round; what the drafting mode compares.",
            ["mode"],
        )
        self.drafting_seconds = {m: self.spec_cache_round_seconds.labels(mode=m) for m in DRAFTING_MODES}
        self.spec_cache_round_tokens = c(
            "spec_cache_round_tokens",
            "Tokens those rounds settled, by mode (summed over their requests).",
            ["mode"],
        )
        self.drafting_tokens = {m: self.spec_cache_round_tokens.labels(mode=m) for m in DRAFTING_MODES}
        self.queued_drafts = c(
            "queued_drafts",
            "Requests whose next drafts the drafter queued on its device right behind the sampler (a "
            "co-located drafter without a DraftStep; one in another process on this host by a step sent "
            "while the target's forward runs), one per request and round.",
        )
        self.tables_ahead_served = c(
            "queued_tables_served",
            "Queued rounds with tables ahead (--queued-tables) whose drafts were the tables' (every "
            "request's outcome was in its table, looked up on the drafter's GPU) rather than the serial "
            "drafts; the lookups themselves count in spec_cache_lookups (hit, miss).",
        )
        self.drafts_read_on_device = c(
            "queued_drafts_read_on_device",
            "Verifications that read a drafter process's queued drafts on this GPU, behind the drafter's GPU "
            "writing them, instead of waiting for its answer (greedy rows; rows new since join beside them).",
        )
        self.launched_ahead = c(
            "verifications_launched_ahead",
            "Verifications whose forward was queued on this GPU right behind the last one's launch, before "
            "its tokens reached the host: the steady state of a greedy batch reading its queued drafts here.",
        )
        self.rows_sat_out = c(
            "queued_drafts_sat_out",
            "Rows of a serial step (new requests, mostly) that sat a verification out, their drafts not in, "
            "while the rest of the batch read its queued drafts on this GPU; one per request and round.",
        )
        self.requests_rejected = c(
            "requests_rejected", "Requests refused before they were queued, by error code.", ["code"]
        )
        self.rejected = {code: self.requests_rejected.labels(code=code) for code in REJECT_CODES}
        self.max_requests_waiting = g("max_requests_waiting", "Capacity of the waiting queue.")
        self.kv_slots = g("kv_slots", "KV-cache slots of the target, in use or in total.", ["state"])
        self._accepted_at: list[Counter] = []  # num_accepted_tokens_per_pos children, bound when first seen
        self._drafted_at: list[Counter] = []  # num_draft_tokens_per_pos children, likewise

    def observe_verification(self, num_draft_tokens: Sequence[int], num_accepted: Sequence[int]) -> None:
        """Counts one verify step: per request, the draft tokens it verified and how many were accepted."""
        drafts = 0
        for drafted, accepted in zip(num_draft_tokens, num_accepted, strict=True):
            if not 0 <= accepted <= drafted:
                raise ValueError(f"accepted {accepted} draft tokens out of {drafted}")
            drafts += drafted > 0
        self.num_drafts.inc(drafts)
        self.num_draft_tokens.inc(sum(num_draft_tokens))
        self.num_accepted_tokens.inc(sum(num_accepted))
        longest = max(num_draft_tokens, default=0)
        while len(self._accepted_at) < longest:
            position = str(len(self._accepted_at))
            self._accepted_at.append(self.num_accepted_tokens_per_pos.labels(position=position))
            self._drafted_at.append(self.num_draft_tokens_per_pos.labels(position=position))
        for position in range(longest):  # requests that drafted / accepted more than `position` drafts
            self._drafted_at[position].inc(sum(drafted > position for drafted in num_draft_tokens))
            self._accepted_at[position].inc(sum(accepted > position for accepted in num_accepted))


class DrafterMetrics(_ServiceMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.draft_step_time = self._histogram(
            "drafter_step_seconds", "Compute time of one DraftStep (updates + drafting).", STEP_BUCKETS
        )
        self.num_requests = self._gauge("drafter_num_requests", "Requests whose state the drafter holds.")
        self.draft_tokens = self._counter("drafter_draft_tokens", "Draft tokens proposed.")
