"""specwire.wire: tensors survive the trip bit for bit, and malformed messages are refused by name."""

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specwire.v1 import drafter_pb2 as pb
from specwire.wire import (
    WireError,
    as_numpy,
    decode_tensor,
    encode_arrays,
    encode_row_blocks,
    encode_tensor,
    from_numpy,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64]


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple),
    seed=st.integers(0, 2**31),
)
def test_round_trip_is_bit_exact(dtype, shape, seed):
    x = _random(shape, dtype, torch.Generator().manual_seed(seed))
    y = decode_tensor(pb.Tensor.FromString(encode_tensor(x).SerializeToString()))
    assert y.dtype == dtype and y.shape == x.shape
    # Compare raw bits so NaN payloads and -0.0 count too.
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    assert torch.equal(y.view(width), x.view(width))


def test_bytes_are_little_endian_row_major():
    x = torch.tensor([[1.5, -2.0], [3.25, 0.0]])
    assert encode_tensor(x).data == struct.pack("<4f", 1.5, -2.0, 3.25, 0.0)
    assert encode_tensor(torch.tensor([1, -2], dtype=torch.int64)).data == struct.pack("<2q", 1, -2)
    # bfloat16 is the top half of float32: 1.0 = 0x3F80.
    assert encode_tensor(torch.tensor([1.0], dtype=torch.bfloat16)).data == b"\x80\x3f"


def test_strided_and_transposed_inputs_encode_their_values():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    message = encode_tensor(x.t())
    assert list(message.shape) == [4, 3]
    expected = np.ascontiguousarray(x.numpy().T).astype("<f4").tobytes()
    assert message.data == expected
    assert torch.equal(decode_tensor(message), x.t())


def test_decoded_tensor_owns_its_memory():
    message = encode_tensor(torch.ones(4))
    y = decode_tensor(message)
    y += 1  # would raise or corrupt the message if it aliased the immutable bytes
    assert decode_tensor(message).tolist() == [1.0] * 4


@pytest.mark.parametrize(
    ("message", "kwargs", "needle"),
    [
        (pb.Tensor(data=b"\0" * 4, dtype=pb.DTYPE_UNSPECIFIED, shape=[1]), {}, "unknown dtype enum value 0"),
        (pb.Tensor(data=b"\0" * 4, dtype=99, shape=[1]), {}, "unknown dtype enum value 99"),
        (pb.Tensor(data=b"\0" * 7, dtype=pb.DTYPE_FLOAT32, shape=[2]), {}, "7 bytes, shape [2]"),
        (pb.Tensor(data=b"\0" * 8, dtype=pb.DTYPE_FLOAT32, shape=[-2]), {}, "negative dimension"),
        (pb.Tensor(data=b"\0" * 8, dtype=pb.DTYPE_FLOAT32, shape=[2]), {"ndim": 2}, "has 1 dims, expected 2"),
        (
            pb.Tensor(data=b"\0" * 8, dtype=pb.DTYPE_INT64, shape=[1]),
            {"dtypes": (torch.float32,)},
            "dtype torch.int64 not allowed",
        ),
        (pb.Tensor(data=b"", dtype=pb.DTYPE_FLOAT32, shape=[1 << 20, 1 << 20]), {}, "over the bound"),
        (pb.Tensor(data=b"\0" * 40, dtype=pb.DTYPE_FLOAT32, shape=[10]), {"max_elements": 9}, "bound 9"),
    ],
)
def test_malformed_messages_raise_wire_error(message, kwargs, needle):
    with pytest.raises(WireError, match="probs") as info:
        decode_tensor(message, name="probs", **kwargs)
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unsupported_dtype_refused_on_encode():
    with pytest.raises(WireError, match="float64"):
        encode_tensor(torch.zeros(2, dtype=torch.float64))


def test_empty_tensor_round_trips():
    y = decode_tensor(encode_tensor(torch.zeros(0, 49152)))
    assert y.shape == (0, 49152) and y.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_blocks_equal_encoding_each_block(dtype):
    x = _random((7, 3, 2), dtype, torch.Generator().manual_seed(3))
    counts = [2, 0, 4, 1]
    blocks = encode_row_blocks(x, counts)
    assert blocks == [encode_tensor(part) for part in x.split(counts)]
    with pytest.raises(WireError, match="do not split"):
        encode_row_blocks(x, [2, 4])


FLOATS = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("held", FLOATS)
@pytest.mark.parametrize("wanted", FLOATS)
def test_arrays_encode_as_torch_would_convert_them(held, wanted):
    """The verifier's feature rows: numpy views (column picks, row slices) of a table of one dtype, sent as
    another; each message decodes to torch's conversion of the same rows, bit for bit."""
    g = torch.Generator().manual_seed(5)
    tables = [_random((n, 12), held, g) for n in (3, 0, 5)]
    columns = np.array([0, 1, 2, 8, 9, 10])  # a gather, as for non-adjacent aux layers
    picks = [(as_numpy(t)[1:, columns], held) for t in tables] + [(as_numpy(tables[2])[:, 4:10], held)]
    messages = encode_arrays(picks, wanted)
    expected = [t[1:, columns].to(wanted) for t in tables] + [tables[2][:, 4:10].to(wanted)]
    for message, want in zip(messages, expected, strict=True):
        got = decode_tensor(message)
        assert got.dtype == wanted and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_numpy_views_share_the_tensors_memory():
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    as_numpy(t)[0, 1] = as_numpy(torch.tensor([1.5], dtype=torch.bfloat16))[0]
    assert t[0, 1].item() == 1.5 and from_numpy(as_numpy(t), torch.bfloat16).data_ptr() == t.data_ptr()
