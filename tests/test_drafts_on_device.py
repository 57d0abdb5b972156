"""Queued drafts a drafter process returns on the device (QueuedDrafts.on_device): when the verifier reads
them there instead of waiting for the answer, and, on a GPU, that its stream waits for the drafter's number,
clamps garbage ids into the vocabulary, and is released from the host when the number never comes."""

import time

import pytest
import torch
from specwire.verifier.alignment import Want
from specwire.verifier.drafter_link import DeviceDrafts, QueuedDrafts

from specwire.stream_values import HostSlot, write_value

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
    device = DeviceDrafts(torch.zeros(8 * K, 1, dtype=torch.int64), slot, 1, K) if on_device else None
    return QueuedDrafts(list(ids), wants, None, answer=_no_answer, vocab_size=100, on_device=device)


GREEDY = Want(3, 0.0, 0)


@pytest.mark.parametrize("case, wants, ids, room, width", [
    ("read on the device", [GREEDY] * 3, ["a", "b", "c"], [4, 4, 3], 3),
    ("another order", [GREEDY] * 3, ["b", "a", "c"], [4, 4, 4], 0),
    ("a request gone", [GREEDY] * 3, ["a", "b"], [4, 4], 0),
    ("a sampled row (q in the answer)", [GREEDY, Want(3, 1.0, 8), GREEDY], ["a", "b", "c"], [4] * 3, 0),
    ("rows asking different numbers", [GREEDY, Want(2, 0.0, 0), GREEDY], ["a", "b", "c"], [4] * 3, 0),
    ("a row without room for them", [GREEDY] * 3, ["a", "b", "c"], [4, 2, 4], 0),
    ("more drafts than the buffer's width", [Want(K + 1, 0.0, 0)] * 3, ["a", "b", "c"], [9] * 3, 0),
])
def test_drafts_are_read_on_the_device_only_for_the_same_greedy_rows(slot, case, wants, ids, room, width):
    assert _queued(slot, wants).device_width(ids, room) == width, case


def test_drafts_are_not_read_on_the_device_without_a_buffer_or_once_answered(slot):
    assert _queued(slot, [GREEDY] * 3, on_device=False).device_width(["a", "b", "c"], [4] * 3) == 0
    answered = _queued(slot, [GREEDY] * 3)
    answered.answer = None  # arrive() has read the answer: its drafts go through the host's checks
    assert answered.device_width(["a", "b", "c"], [4] * 3) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_reads_the_drafts_once_written_and_a_release_from_the_host_ends_its_wait(slot):
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    buffer = torch.zeros(2 * K, 1, dtype=torch.int64, device=device)
    # Made before the wait: while the current stream waits, nothing may sync with it (a host-to-device copy
    # from pageable memory would, and hang the test)
    written = torch.tensor([[5, 10**9, -3, 7], [1, 2, 99, 100]], device=device)
    drafter = torch.cuda.Stream(device)  # as a drafter's GPU: the drafts, then the number behind them
    torch.cuda.synchronize(device)
    with torch.cuda.device(device):
        ids = DeviceDrafts(buffer, slot, 1, K).read(2, 3, vocab_size=100)
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.05)
        assert not done.query(), "the read did not wait for the drafter's number"
        with torch.cuda.stream(drafter):
            buffer.view(2, K).copy_(written)
            write_value(slot, 1, drafter)
        torch.cuda.synchronize(device)
        assert ids.tolist() == [5, 99, 0, 1, 2, 99], "ids outside the vocabulary must be clamped into it"

        stalled = DeviceDrafts(buffer, slot, 2, K)
        again = stalled.read(2, 2, vocab_size=100)
        done.record()
        time.sleep(0.05)
        assert not done.query()
        stalled.release()  # the drafter died: the buffer is read as it is
        deadline = time.monotonic() + 10
        while not done.query():
            assert time.monotonic() < deadline, "the host's release did not end the GPU's wait"
            time.sleep(0.001)
        assert again.tolist() == [5, 99, 1, 2] and slot.value == 2
