"""Queued drafts a drafter process returns on the device (QueuedDrafts.on_device): when the verifier reads
them there instead of waiting for the answer, and, on a GPU, that its stream waits for the drafter's number,
clamps garbage ids into the vocabulary, and is released from the host when the number never comes."""

import time

import pytest
import torch
from specwire.verifier.alignment import Want
from specwire.verifier.drafter_link import DeviceDrafts, QueuedDrafts

from specwire.stream_values import HostSlot, SlotWatch, write_value

K = 4


async def _no_answer():
    return None


@pytest.fixture
def slot():
    s = HostSlot()
    yield s
    s.unlink()
    s.close()


def _queued(slot: HostSlot, wants: list[Want], ids=("a", "b", "c"), on_device: bool = True) -> QueuedDrafts:
    device = DeviceDrafts(torch.zeros(8 * K, 1, dtype=torch.int64), slot, 1, K, SlotWatch(), 0.5) \
        if on_device else None
    return QueuedDrafts(list(ids), wants, None, answer=_no_answer, vocab_size=100, on_device=device)


GREEDY = Want(3, 0.0, 0)


@pytest.mark.parametrize("case, wants, ids, room, rows", [
    ("read on the device", [GREEDY] * 3, ["a", "b", "c"], [4, 4, 3], [(0, 3), (1, 3), (2, 3)]),
    ("requests gone since", [GREEDY] * 3, ["a", "c"], [4, 4], [(0, 3), (2, 3)]),
    ("rows asking different numbers", [GREEDY, Want(2, 0.0, 0), GREEDY], ["a", "b", "c"], [4] * 3,
     [(0, 3), (1, 2), (2, 3)]),
    ("rows cut to their room", [GREEDY] * 3, ["a", "b", "c"], [4, 2, 0], [(0, 3), (1, 2), (2, 0)]),
    ("no room for any", [GREEDY] * 3, ["a", "b"], [0, 0], None),
    ("another order", [GREEDY] * 3, ["b", "a", "c"], [4, 4, 4], None),
    ("a request the drafts are not for", [GREEDY] * 3, ["a", "d"], [4, 4], None),
    ("a sampled row (q in the answer)", [GREEDY, Want(3, 1.0, 8), GREEDY], ["a", "b", "c"], [4] * 3, None),
    ("more drafts than the buffer's width", [Want(K + 1, 0.0, 0)] * 3, ["a", "b", "c"], [9] * 3, None),
])
def test_drafts_are_read_on_the_device_for_greedy_rows_in_their_order(slot, case, wants, ids, room, rows):
    assert _queued(slot, wants).device_rows(ids, room) == rows, case


def test_a_sampled_row_gone_since_does_not_keep_the_others_off_the_device(slot):
    queued = _queued(slot, [GREEDY, Want(3, 1.0, 8), GREEDY])
    assert queued.device_rows(["a", "c"], [4, 4]) == [(0, 3), (2, 3)]


def test_drafts_are_not_read_on_the_device_without_a_buffer_or_once_answered(slot):
    assert _queued(slot, [GREEDY] * 3, on_device=False).device_rows(["a", "b", "c"], [4] * 3) is None
    answered = _queued(slot, [GREEDY] * 3)
    answered.answer = None  # arrive() has read the answer: its drafts go through the host's checks
    assert answered.device_rows(["a", "b", "c"], [4] * 3) is None


@pytest.mark.parametrize("rows", [[(0, 2), (1, 2)], [(0, K), (1, K), (2, K)], [(1, 3), (3, 1)],
                                  [(0, 3), (1, 0)]])
def test_the_rows_read_are_each_rows_first_drafts_clamped_into_the_vocabulary(rows):
    """DeviceDrafts.pick against a plain gather: the buffer's lead rows as a slice, any others by an
    index; ids past the vocabulary or below 0 clamped into it."""
    buffer = torch.arange(-3, 6 * K - 3, dtype=torch.int64).view(-1, 1) * 7
    table = buffer.view(6, K)
    expected = [min(max(int(table[row, j]), 0), 99) for row, n in rows for j in range(n)]
    assert DeviceDrafts.pick(buffer, rows, K, vocab_size=100).tolist() == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_reads_the_drafts_once_written_and_a_stalled_wait_is_ended_from_the_host(slot):
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    buffer = torch.zeros(2 * K, 1, dtype=torch.int64, device=device)
    # Made before the wait: while the current stream waits, nothing of this thread may sync with it, and a
    # kernel's first launch (its module loaded lazily) or a copy from pageable memory would, hanging the test
    # (a drafter's writes come from another process)
    written = torch.tensor([[5, 10**9, -3, 7], [1, 2, 99, 100]], device=device)
    for rows in ([(0, 3), (1, 3)], [(0, 2), (1, 2)], [(1, 1)]):  # the slice and the index paths
        DeviceDrafts.pick(buffer, rows, K, 100)
    drafter = torch.cuda.Stream(device)  # as a drafter's GPU: the drafts, then the number behind them
    with torch.cuda.stream(drafter):
        buffer.view(2, K).copy_(buffer.view(2, K))
    torch.cuda.synchronize(device)
    with torch.cuda.device(device):
        releases = []
        watch = SlotWatch(lambda: releases.append(slot.value))
        ids = DeviceDrafts(buffer, slot, 1, K, watch, 30.0).read([(0, 3), (1, 3)], vocab_size=100)
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.05)
        assert not done.query(), "the read did not wait for the drafter's number"
        with torch.cuda.stream(drafter):
            buffer.view(2, K).copy_(written)
            write_value(slot, 1, drafter)
        torch.cuda.synchronize(device)
        assert ids.tolist() == [5, 99, 0, 1, 2, 99], "ids outside the vocabulary must be clamped into it"

        assert not releases, "a wait that ended in time was released"
        again = DeviceDrafts(buffer, slot, 2, K, watch, 0.3).read([(1, 2)], vocab_size=100)  # no write comes
        done.record()
        time.sleep(0.05)
        assert not done.query()
        deadline = time.monotonic() + 10
        while not done.query():  # the watch ends the wait: the buffer is read as it is
            assert time.monotonic() < deadline, "the stalled wait was not ended from the host"
            time.sleep(0.001)
        assert again.tolist() == [1, 2] and releases == [2]
