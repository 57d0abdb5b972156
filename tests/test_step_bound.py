"""A step to a remote drafter stays under its message bound when requests catch up. After a stall (steps
unanswered, so none could be sent) the requests have settled many tokens the drafter was not told; their
features count against the bound like a whole prompt's do, and requests that do not fit wait for a later step.
Before, only whole prompts counted: on the 8B shape over the step socket, catch-up steps of 67-92 MB went over
the 64 MiB bound and each dropped the link (bench/results/session27/)."""

import numpy as np
import torch
from specwire.verifier.scheduler import FeatureRows, Request, Scheduler, SchedulerConfig
from test_services_e2e import MAX_CONTEXT, tiny_target

from specwire.engine import TargetEngine
from specwire.metrics import VerifierMetrics
from specwire.sampling_params import SamplingParams
from specwire.synthetic import synthetic_tokenizer
from specwire.v1 import drafter_pb2 as dpb
from specwire.wire import decode_tensor

ROWS_A_STEP = 40  # the bound below leaves room for this many float32 feature rows a step


class RemoteLink:
    """What the scheduler sees of a remote drafter (features travel in the step), recording each step."""

    feature_device = None
    queues_drafts = False

    def __init__(self, info: dpb.DrafterInfo, max_step_bytes: int):
        self.info, self.max_step_bytes, self.sent = info, max_step_bytes, []

    def can_send(self) -> bool:
        return True

    def send(self, step: dpb.DraftStep, tensors: dict) -> object:
        assert not tensors
        self.sent.append(step)
        return object()  # the step's answer: not read by this test


def scheduler_with_told_requests(lengths: list[tuple[int, int]]
                                 ) -> tuple[Scheduler, RemoteLink, list[Request]]:
    """Requests of (tokens, tokens the drafter was told) each; features row i = [i, request number]."""
    config, sd = tiny_target()
    engine = TargetEngine(checkpoint=(config, sd), device="cpu", dtype=torch.float32, max_slots=8,
                          max_context=MAX_CONTEXT)
    hidden = config.hidden_size
    info = dpb.DrafterInfo(feature_dim=hidden, feature_dtype=dpb.DTYPE_FLOAT32, max_num_drafts=4)
    link = RemoteLink(info, ROWS_A_STEP * hidden * 4)
    scheduler = Scheduler(engine, synthetic_tokenizer(config), VerifierMetrics(),
                          SchedulerConfig(num_speculative_tokens=4, cache_branches=0), link)
    scheduler.check_drafter(info)
    requests = []
    for n, (length, told) in enumerate(lengths):
        r = Request(f"r{n}", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=200), 0, frozenset(), None)
        r.tokens = [(7 * n + i) % 50 for i in range(length)]
        rows = np.zeros((length - 1, hidden), np.float32)
        rows[:, 0], rows[:, 1] = np.arange(length - 1), n
        r.features, r.drafter_len = FeatureRows(rows, torch.float32), told
        requests.append(r)
    scheduler.running = list(requests)
    return scheduler, link, requests


def told_rows(step: dpb.DraftStep) -> dict[str, tuple[int, list[int], np.ndarray]]:
    """Per request the step updates: (first position told, token ids, feature rows)."""
    told = {}
    for u in step.updates:
        kind = u.WhichOneof("kind")
        body = getattr(u, kind)
        if kind in ("new_request", "accepted"):
            features = decode_tensor(body.features).numpy()
            told[u.request_id] = (getattr(body, "position", 0), list(body.token_ids), features)
    return told


def test_catch_up_after_a_stall_goes_over_in_steps_under_the_bound():
    # Six requests the drafter knows up to token 10, each 30 tokens further on: 180 rows of catch-up.
    scheduler, link, requests = scheduler_with_told_requests([(40, 10)] * 6)
    for _ in range(10):
        if all(r.drafter_len == len(r.tokens) for r in requests):
            break
        scheduler._send_step(requests, "serial")
    assert all(r.drafter_len == len(r.tokens) for r in requests), "some request was never caught up"
    assert len(link.sent) > 1
    seen: dict[str, list] = {r.id: [] for r in requests}
    for step in link.sent:
        assert step.ByteSize() <= link.max_step_bytes * 4 // 3, "a step passed the link's message bound"
        told = told_rows(step)
        assert sum(len(f) for _, _, f in told.values()) <= ROWS_A_STEP
        for rid, (position, ids, features) in told.items():
            seen[rid].append((position, ids, features))
            wants = [w.request_id for w in step.wants]
            assert rid in wants  # told requests are drafted in the same step
    for n, r in enumerate(requests):
        (position, ids, features), = seen[r.id]  # each request's catch-up went over whole, in one step
        assert position == 10 and ids == r.tokens[10:]
        # the features of the positions before those tokens: rows 9..38, this request's
        np.testing.assert_array_equal(features[:, 0], np.arange(9, 39))
        assert (features[:, 1] == n).all()


def test_a_catch_up_that_fits_goes_in_one_step_with_new_requests():
    scheduler, link, requests = scheduler_with_told_requests([(12, 8), (12, 8), (9, 0)])
    scheduler._send_step(requests, "serial")
    assert len(link.sent) == 1 and all(r.drafter_len == len(r.tokens) for r in requests)
    told = told_rows(link.sent[0])
    assert [len(told[r.id][2]) for r in requests] == [4, 4, 8]
