"""The shared slot a drafter's GPU waits on (specwire/stream_values.py), on its host side: the file both
processes map, what either writes the other reads, the paths it refuses, and the drafter's bounded wait for a
verifier that never writes it; on a GPU, that the release value ends a stream's wait. (The rest of the
GPUs' side, the stream operations, runs in the GPU tests of queued drafts across processes,
tests/test_shared_features.py.)"""

import multiprocessing as mp
import os
import time

import pytest
import torch
from specwire.drafter.server import SettleTimeout, _SharedOutput

from specwire.stream_values import RELEASED, SLOT_DIR, HostSlot, SlotWatch, wait_value


def _write_from_another_process(path: str, value: int) -> None:
    slot = HostSlot(path)
    slot.set(value)
    slot.close()


def test_a_slot_is_shared_with_another_process_by_its_path():
    slot = HostSlot()
    try:
        assert os.path.dirname(slot.path) == SLOT_DIR and slot.value == 0
        writer = mp.get_context("spawn").Process(target=_write_from_another_process, args=(slot.path, 41))
        writer.start()
        writer.join(60)
        assert writer.exitcode == 0 and slot.value == 41
        slot.set(2**64 - 1)  # the whole unsigned range
        assert HostSlot(slot.path).value == 2**64 - 1
    finally:
        slot.unlink()
        slot.close()
    assert not os.path.exists(slot.path)
    slot.unlink()  # twice is fine: either process may have done it


@pytest.mark.parametrize("path, error", [
    ("/etc/passwd", "a slot is a file /dev/shm/specwire-slot-"),
    ("/dev/shm/../etc/specwire-slot-x", "a slot is a file"),
    ("/dev/shm/other-file", "a slot is a file"),
])
def test_a_path_that_is_not_a_slot_is_refused_before_it_is_opened(path, error):
    with pytest.raises(ValueError, match=error):
        HostSlot(path)


def test_a_missing_or_short_slot_file_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError):
        HostSlot(f"{SLOT_DIR}/specwire-slot-never-made")
    short = f"{SLOT_DIR}/specwire-slot-test-short-{os.getpid()}"
    with open(short, "wb") as f:
        f.write(b"\0" * 8)
    try:
        with pytest.raises(ValueError, match="is not a slot"):
            HostSlot(short)
    finally:
        os.unlink(short)


def test_the_drafter_waits_for_the_number_then_gives_up_and_releases_its_gpu():
    slot = HostSlot()
    try:
        shared = _SharedOutput(buffer=None, slot=slot)
        slot.set(3)
        started = time.monotonic()
        shared.await_number(3, timeout=5.0)  # written already: no wait
        assert time.monotonic() - started < 1.0
        with pytest.raises(SettleTimeout, match="did not settle step 4 in 0.2 s"):  # counted as a link fault
            shared.await_number(4, timeout=0.2)
        assert slot.value == 4, "the drafter's own GPU, waiting for 4, must be released"
    finally:
        slot.unlink()
        slot.close()


def test_a_cpu_drafter_lets_go_of_a_slot_it_was_offered():
    """A slot offered beside a sampler buffer in host memory is mapped, then refused (test_shared_features):
    the stream's end lets go of it without a GPU to wait for."""
    slot = HostSlot()
    try:
        shared = _SharedOutput(buffer=None, slot=HostSlot(slot.path))
        shared.close(torch.device("cpu"))
        assert shared.slot is None and slot.value == RELEASED
    finally:
        slot.unlink()
        slot.close()


def _until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def test_a_watched_wait_not_written_in_time_is_ended_from_the_host_and_one_written_is_not():
    """SlotWatch, which ends a verifier GPU's wait for drafts a drafter process never wrote: it writes the
    number once the deadline passes, only if the writer has not, and watches the latest wait only."""
    slot = HostSlot()
    released = []
    watch = SlotWatch(lambda: released.append(slot.value))
    try:
        watch.watch(slot, 3, 0.1)
        assert _until(lambda: slot.value == 3) and released == [3]
        watch.watch(slot, 4, 0.1)
        slot.set(4)  # written in time
        time.sleep(0.3)
        assert slot.value == 4 and released == [3]
        watch.watch(slot, 5, 30.0)
        time.sleep(0.05)  # the thread sleeps towards the 30 s deadline
        watch.watch(slot, 6, 0.1)  # replaces it: 6 is written, the 30 s deadline is gone with it
        assert _until(lambda: slot.value == 6) and released == [3, 6]
    finally:
        slot.unlink()
        slot.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_released_slot_ends_a_gpu_wait_for_any_step_number():
    """RELEASED ends a stream's wait for a number never written (a drafter or verifier gone): the GPU's
    comparison is cyclic, (int64)(slot - wanted) >= 0, so the value must lie ahead of every step number, not
    merely be the largest unsigned one (2**64 - 1 reads as -1: the stream would wait for good)."""
    slot = HostSlot()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # the kernels loaded first: a module's first load waits for the device
        torch.ones(4, device="cuda").sum()
    torch.cuda.synchronize()
    try:
        for wanted in (1, 7, 2**40):
            slot.set(0)
            wait_value(slot, wanted, stream)
            done = torch.cuda.Event()
            with torch.cuda.stream(stream):
                torch.ones(4, device="cuda").sum()
                done.record()
            time.sleep(0.05)
            assert not done.query(), "the stream did not wait"
            slot.set(RELEASED)
            ended = _until(done.query, 5.0)
            slot.set(wanted)  # (whatever happened, the stream goes on)
            assert ended, f"RELEASED did not end a wait for {wanted}"
        torch.cuda.synchronize()
    finally:
        slot.unlink()
        slot.close()

