"""Tensor <-> `specwire.v1.Tensor` codec: raw little-endian bytes, a dtype and a shape, checked on the way in.

Decoding never trusts the sender: the dtype must be one we know, the byte count must match the shape, and the
element count is bounded, so a bad or hostile payload raises `WireError` instead of allocating or misreading.
"""

import math
import sys
from collections.abc import Sequence

import numpy as np
import torch

from specwire.v1 import drafter_pb2 as pb

# Version of the verifier <-> drafter protocol (drafter.proto semantics), checked in the handshake.
PROTOCOL_VERSION = 1

# 1 << 26 float32 elements is 256 MiB, far above any real payload (a [64 x 4, 49152] dense probs is 50 M).
DEFAULT_MAX_ELEMENTS = 1 << 26

# The DType enum's tensors, both ways; target features travel as one of FEATURE_DTYPES.
TORCH_DTYPE = {
    pb.DTYPE_FLOAT32: torch.float32,
    pb.DTYPE_BFLOAT16: torch.bfloat16,
    pb.DTYPE_FLOAT16: torch.float16,
    pb.DTYPE_INT32: torch.int32,
    pb.DTYPE_INT64: torch.int64,
}
WIRE_DTYPE = {v: k for k, v in TORCH_DTYPE.items()}
FEATURE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# bfloat16 has no numpy twin, so its bytes travel through a same-width integer view.
_BYTE_VIEW = {torch.bfloat16: torch.int16}

# The wire is little-endian and tensors are copied as raw memory, which is only right on a little-endian host.
if sys.byteorder != "little":
    raise ImportError("specwire.wire needs a little-endian host")


class WireError(ValueError):
    """A Tensor message (or a tensor to encode) is malformed; the message names the bad value."""


def encode_tensor(tensor: torch.Tensor) -> pb.Tensor:
    """Copies `tensor` (any device, any strides) into a Tensor message."""
    host, data = _host_bytes(tensor)
    return pb.Tensor(data=data, dtype=WIRE_DTYPE[host.dtype], shape=list(host.shape))


def encode_row_blocks(tensor: torch.Tensor, counts: Sequence[int]) -> list[pb.Tensor]:
    """Consecutive blocks of counts[i] rows of `tensor` as one Tensor message each, from a single copy to
    bytes (what encode_tensor of each block gives, for one conversion instead of one per block)."""
    if tensor.dim() < 1 or sum(counts) != tensor.shape[0] or min(counts, default=0) < 0:
        raise WireError(f"row blocks {list(counts)} do not split a tensor of shape {list(tensor.shape)}")
    host, data = _host_bytes(tensor)
    rest = list(host.shape[1:])
    row_bytes = math.prod(rest) * host.element_size()
    messages, start = [], 0
    for n in counts:
        end = start + n * row_bytes
        messages.append(pb.Tensor(data=data[start:end], dtype=WIRE_DTYPE[host.dtype], shape=[n, *rest]))
        start = end
    return messages


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array, shared (bfloat16 as its raw 16 bits: numpy has no twin)."""
    return tensor.view(_BYTE_VIEW.get(tensor.dtype, tensor.dtype)).numpy()


def from_numpy(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """as_numpy's inverse: the array's memory as a tensor of `dtype`, shared."""
    return torch.from_numpy(array).view(dtype)


def encode_arrays(arrays: Sequence[tuple[np.ndarray, torch.dtype]], dtype: torch.dtype) -> list[pb.Tensor]:
    """Arrays, each the raw memory of the dtype paired with it (as as_numpy gives it; any strides), as Tensor
    messages of `dtype`: their bytes as they are where the dtypes match, else converted by torch in one go."""
    if all(held == dtype for _, held in arrays):
        return [pb.Tensor(data=a.tobytes(), dtype=WIRE_DTYPE[dtype], shape=list(a.shape)) for a, _ in arrays]
    if len({a.shape[1:] for a, _ in arrays}) > 1:
        raise WireError(f"arrays of shapes {[list(a.shape) for a, _ in arrays]} differ past their first dim")
    rows = torch.cat([from_numpy(a, held).to(dtype) for a, held in arrays])
    return encode_row_blocks(rows, [len(a) for a, _ in arrays])


def _host_bytes(tensor: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    """The tensor on the CPU, and its raw bytes in row-major order (numpy copies any strides to bytes in one
    call, so a strided view, such as a branch's q, needs no contiguous copy first)."""
    if tensor.dtype not in WIRE_DTYPE:
        raise WireError(f"cannot encode dtype {tensor.dtype}; supported: {sorted(map(str, WIRE_DTYPE))}")
    host = tensor.detach().cpu()
    return host, as_numpy(host).tobytes()


def decode_tensor(
    message: pb.Tensor,
    *,
    dtypes: tuple[torch.dtype, ...] | None = None,
    ndim: int | None = None,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
    name: str = "tensor",
) -> torch.Tensor:
    """Returns a CPU tensor that owns a copy of `message`'s bytes.

    `dtypes` and `ndim` narrow what the caller accepts; `name` labels errors ("proposal r1 probs").
    """
    dtype = TORCH_DTYPE.get(message.dtype)
    if dtype is None:
        raise WireError(f"{name}: unknown dtype enum value {message.dtype}")
    if dtypes is not None and dtype not in dtypes:
        raise WireError(f"{name}: dtype {dtype} not allowed here; expected one of {[str(d) for d in dtypes]}")
    shape = tuple(message.shape)
    if ndim is not None and len(shape) != ndim:
        raise WireError(f"{name}: shape {list(shape)} has {len(shape)} dims, expected {ndim}")
    if any(d < 0 for d in shape):
        raise WireError(f"{name}: negative dimension in shape {list(shape)}")
    numel = math.prod(shape)
    if numel > max_elements:
        raise WireError(f"{name}: shape {list(shape)} has {numel} elements, over the bound {max_elements}")
    need = numel * dtype.itemsize
    if len(message.data) != need:
        raise WireError(f"{name}: {len(message.data)} bytes, shape {list(shape)} of {dtype} needs {need}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: torch.frombuffer wants writable memory, and the copy frees us from the message's lifetime.
    flat = torch.frombuffer(bytearray(message.data), dtype=_BYTE_VIEW.get(dtype, dtype))
    return flat.view(dtype).reshape(shape)
