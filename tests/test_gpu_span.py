"""GpuSpan: the device time between two points of a stream, from CUDA events."""

import time

import pytest
import torch

from specwire.gpu_span import GpuSpan


def test_a_cpu_span_has_no_device_time():
    span = GpuSpan(torch.device("cpu"))
    span.begin()
    span.end()
    assert span.seconds() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_span_times_the_work_queued_inside_it_once():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    a = torch.randn(4096, 4096, device=device)
    span = GpuSpan(device)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    span.begin()
    for _ in range(20):
        a = a @ a / 64
    span.end()
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - started
    seconds = span.seconds()
    # Twenty 4096^3 matmuls: far more than a launch's microseconds, never more than the wall time around them.
    assert 1e-4 < seconds <= wall
    assert span.seconds() is None  # read once
    span.begin()  # a span begun but not ended has no time
    assert span.seconds() is None
