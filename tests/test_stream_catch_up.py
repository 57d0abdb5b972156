"""A Generate stream that fell behind its request (the verifier's loop busy with rounds) sends every output
already waiting in one chunk (verifier.server.with_waiting): nothing lost, reordered or taken past the end."""

import asyncio

from specwire.verifier.scheduler import Output
from specwire.verifier.server import with_waiting


def queue_of(*outputs: Output) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()
    for out in outputs:
        q.put_nowait(out)
    return q


def test_waiting_outputs_join_the_first_up_to_the_one_that_finishes():
    q = queue_of(Output([2, 3], "b"), Output([4], "c", "length"), Output([9], "x"))
    assert with_waiting(q, Output([1], "a")) == (Output([1, 2, 3, 4], "abc", "length"), 2)
    assert q.qsize() == 1  # what comes after the finish is not the stream's


def test_an_error_behind_tokens_keeps_both():
    q = queue_of(Output([], "", "error", "internal error: boom"))
    assert with_waiting(q, Output([5], "e")) == (Output([5], "e", "error", "internal error: boom"), 1)


def test_an_output_with_nothing_behind_it_goes_alone():
    q = queue_of()
    assert with_waiting(q, Output([7], "g")) == (Output([7], "g"), 0)
    finished = Output([8], "h", "stop")
    q = queue_of(Output([9], "i"))
    assert with_waiting(q, finished) == (finished, 0) and q.qsize() == 1
