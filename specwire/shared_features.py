"""Target features shared in GPU memory between a verifier and a drafter on one host (CUDA IPC).

Over gRPC or the step socket, each settled token's features travel as bytes: at the 8B shape 24 KB a token,
read back from the GPU, copied into the message, out of it, and up to the drafter's GPU again (1.9 MB and
6.7 ms a round at batch 16, `bench/results/session27/`). A drafter on the same host can instead map the
verifier's feature table (verifier.feature_store) once per stream and copy the rows a step names straight
from the verifier's GPU. gRPC stays the contract: the step still carries every token id and want, only the
features become row numbers, and a drafter elsewhere (another pod, another host) gets bytes as before.

Mapping goes through torch's own CUDA storage sharing (what torch.multiprocessing does, without its pickles:
the handles travel as protobuf fields and are checked before use).
"""

from __future__ import annotations

import functools
import math

import torch

from specwire.v1 import drafter_pb2 as pb
from specwire.wire import FEATURE_DTYPES, TORCH_DTYPE, WIRE_DTYPE, WireError


@functools.cache
def host_id() -> str:
    """This host's kernel boot id: the same for every process and container on the host, unlike a hostname."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def device_uuid(device: torch.device) -> str:
    """A device's identity across processes: a GPU's UUID; any other device's name (for CPU tests)."""
    device = torch.device(device)
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else str(device)


def visible_gpus() -> list[str]:
    """The UUIDs of the GPUs this process can see, so can map memory of."""
    return [device_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]


def describe(table: torch.Tensor) -> pb.SharedFeatures:
    """The message that lets a drafter on this host map `table` (a CUDA tensor [rows, width] that starts its
    storage, contiguous). The storage must outlive every stream it was offered on."""
    offset = table.storage_offset()
    if table.device.type != "cuda" or table.dim() != 2 or not table.is_contiguous() or offset:
        raise ValueError(f"a shared feature table is a contiguous CUDA tensor [rows, width] at the start of "
                         f"its storage, got {table.device} {list(table.shape)} at offset {offset}")
    shared = table.untyped_storage()._share_cuda_()
    _, handle, size, offset, counter, counter_offset, event, event_sync = shared
    return pb.SharedFeatures(
        device_uuid=device_uuid(table.device), memory_handle=handle, storage_size_bytes=size,
        storage_offset_bytes=offset, ref_counter_handle=counter, ref_counter_offset=counter_offset,
        event_handle=event or b"", event_sync_required=event_sync, shape=list(table.shape),
        dtype=WIRE_DTYPE[table.dtype])


def open_table(message: pb.SharedFeatures, dtypes: tuple[torch.dtype, ...] = FEATURE_DTYPES,
               device: torch.device | None = None) -> torch.Tensor:
    """The verifier's table, mapped into this process; raises WireError naming what is wrong (a dtype not in
    `dtypes`, a GPU this process cannot see, a shape its storage cannot hold) or what CUDA refused.

    device: this process's own GPU. Where it can reach the table's GPU directly (peer access: NVLink or
    PCIe), the table is mapped into its context and is a tensor on it, so every read and write of the table
    is that GPU's work. Otherwise the table is a tensor on its own GPU, and copies from it run there, in a
    second context of this process that takes turns with the verifier's on that GPU (time slices)."""
    dtype = TORCH_DTYPE.get(message.dtype)
    if dtype not in dtypes:
        raise WireError(f"shared features: dtype enum value {message.dtype} is not one of "
                        f"{', '.join(map(str, dtypes))}")
    if len(message.shape) != 2:
        raise WireError(f"shared features: shape {list(message.shape)} is not [rows, width]")
    need = math.prod(message.shape) * dtype.itemsize
    if need > message.storage_size_bytes:
        raise WireError(f"shared features: shape {list(message.shape)} of {dtype} needs {need} bytes, "
                        f"the storage holds {message.storage_size_bytes}")
    if not torch.cuda.is_available():
        raise WireError("shared features: this drafter has no GPU")
    index = next((i for i, uuid in enumerate(visible_gpus()) if uuid == message.device_uuid), None)
    if index is None:
        raise WireError(f"shared features: GPU {message.device_uuid} is not visible to this drafter "
                        f"(CUDA_VISIBLE_DEVICES)")
    own = None if device is None or device.type != "cuda" else (
        device.index if device.index is not None else torch.cuda.current_device())
    if own is not None and own != index and torch.cuda.can_device_access_peer(own, index):
        index = own  # CUDA maps another GPU's memory into this one's context (peer access)
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index, message.memory_handle, message.storage_size_bytes, message.storage_offset_bytes,
            message.ref_counter_handle, message.ref_counter_offset, message.event_handle,
            message.event_sync_required)
    except (RuntimeError, TypeError, ValueError) as e:  # e.g. a handle of another host or of this process
        raise WireError(f"shared features: CUDA could not map the table: {str(e).splitlines()[0]}") from e
    table = torch.empty(0, dtype=dtype, device=torch.device("cuda", index))
    rows, width = message.shape
    return table.set_(storage, 0, (rows, width), (width, 1))


def unreadable_rows(table: torch.Tensor | None, first: int, count: int) -> str:
    """Why rows [first, first + count) of a stream's mapped table cannot be read; empty when they can."""
    if table is None:
        return "features: a shared row reference on a stream that offered no shared table"
    if first + count > table.shape[0]:
        return f"features: shared rows [{first}, {first + count}) past the table's {table.shape[0]}"
    return ""


def shared_rows(table: torch.Tensor | None, first: int, count: int) -> torch.Tensor:
    """Rows [first, first + count) of a stream's mapped table; WireError when they cannot be read."""
    if problem := unreadable_rows(table, first, count):
        raise WireError(problem)
    return table[first:first + count]
