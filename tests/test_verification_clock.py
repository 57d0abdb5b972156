"""VerificationClock: each verification's device time and the device's idle time before it, split into waiting
for the round's launch and waiting for drafts, from CUDA events read once the device has passed them."""

import time

import pytest
import torch

from specwire.verification_clock import VerificationClock


def test_a_cpu_clock_times_nothing():
    clock = VerificationClock(torch.device("cpu"))
    clock.verification_began()
    clock.verification_ended()
    clock.round_queued()
    assert clock.take() == []


def _busy(device: torch.device) -> None:
    a = torch.randn(2048, 2048, device=device)
    for _ in range(10):
        a = a @ a / 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_idle_time_before_a_verification_is_split_at_the_rounds_launch():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    side = torch.cuda.Stream(device)
    clock = VerificationClock(device)
    with torch.cuda.device(device):
        clock.verification_began()
        _busy(device)
        clock.verification_ended()
        torch.cuda.synchronize(device)
        time.sleep(0.02)  # the host takes 20 ms to launch the next round: the device idles
        clock.round_queued()
        with torch.cuda.stream(side):  # the drafts, written on another stream about 20 ms later
            torch.cuda._sleep(50_000_000)
            written = torch.cuda.Event()
            written.record()
        torch.cuda.current_stream(device).wait_event(written)
        clock.verification_began()
        _busy(device)
        clock.verification_ended()
        torch.cuda.synchronize(device)
        first, second = clock.take()
        assert clock.take() == []  # each round once
        assert first.launch_seconds is None and first.drafts_seconds is None  # nothing before it
        assert 0 < first.verify_seconds < 1 and 0 < second.verify_seconds < 1
        assert 0.015 < second.launch_seconds < 1  # the host's 20 ms
        assert 0.005 < second.drafts_seconds < 5  # the side stream's sleep
        clock.other_work()  # a prefill between two verifications: no idle time is measured before the next
        clock.verification_began()
        clock.verification_ended()
        torch.cuda.synchronize(device)
        (third,) = clock.take()
        assert third.launch_seconds is None and third.verify_seconds >= 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_clock_beside_a_co_located_drafter_measures_no_idle_time():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    clock = VerificationClock(device, idle=False)
    for _ in range(2):
        clock.verification_began()
        clock.verification_ended()
    torch.cuda.synchronize(device)
    assert [t.launch_seconds for t in clock.take()] == [None, None]
