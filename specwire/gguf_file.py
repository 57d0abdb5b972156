"""Read a GGUF file: its metadata, its tensor directory, and dequantized tensors.

gguf.GGUFReader builds a numpy view for every element of every metadata array (the 98k tokenizer strings of
SmolLM2 take about 2 s and 160 MB). This parser reads the same layout with `struct` in about 0.1 s and leaves
dequantization to `gguf.quants.dequantize`, so each start of a service stays quick.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from specwire.errors import ModelLoadError

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class _Corrupt(Exception):
    """The header runs past the end of the file or holds an impossible value."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order: GGUF lists dimensions fastest-first, this is reversed
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Metadata and tensor directory of one GGUF file; `tensor(name)` reads and dequantizes on demand."""

    def __init__(self, path: Path, metadata: dict[str, Any], tensors: dict[str, TensorInfo]) -> None:
        self.path = path
        self.metadata = metadata
        self.tensors = tensors

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        path = Path(path)
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                if f.read(4) != _MAGIC:
                    raise ModelLoadError(f"{path}: not a GGUF file (bad magic)")
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                    metadata, tensors = _parse(path, buf, size)
        except OSError as e:
            raise ModelLoadError(f"{path}: cannot read GGUF file ({e.strerror or e})") from e
        except _Corrupt:
            raise ModelLoadError(f"{path}: truncated or corrupt GGUF header") from None
        return cls(path, metadata, tensors)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelLoadError(f"{self.path}: GGUF metadata key {key!r} is missing")
        return self.metadata[key]

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as float32 in PyTorch shape."""
        info = self.tensors[name]
        raw = np.fromfile(self.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        block_size, type_size = GGML_QUANT_SIZES[info.qtype]
        row_bytes = info.shape[-1] // block_size * type_size
        try:
            out = dequantize(raw.reshape(*info.shape[:-1], row_bytes), info.qtype)
        except NotImplementedError:
            raise ModelLoadError(
                f"{self.path}: tensor {name} has unsupported quantization type {info.qtype.name}"
            ) from None
        return out.astype(np.float32, copy=False).reshape(info.shape)


def _parse(path: Path, buf: mmap.mmap, size: int) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    reader = _Reader(buf)
    reader.pos = 4
    version = reader.scalar("<I")
    if version not in _SUPPORTED_VERSIONS:
        raise ModelLoadError(f"{path}: unsupported GGUF version {version} (supported: 2, 3; little-endian)")
    n_tensors, n_kv = reader.scalar("<Q"), reader.scalar("<Q")
    metadata = {}
    for _ in range(n_kv):
        key = reader.string()
        metadata[key] = reader.value(reader.value_type())

    infos = []
    for _ in range(n_tensors):
        name = reader.string()
        n_dims = reader.scalar("<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ModelLoadError(f"{path}: corrupt GGUF: tensor {name} has {n_dims} dimensions")
        dims = [reader.scalar("<Q") for _ in range(n_dims)]
        qtype_id = reader.scalar("<I")
        infos.append((name, dims, qtype_id, reader.scalar("<Q")))

    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-reader.pos // alignment) * alignment
    tensors = {}
    for name, dims, qtype_id, offset in infos:
        try:
            qtype = GGMLQuantizationType(qtype_id)
        except ValueError:
            raise ModelLoadError(f"{path}: tensor {name} has unknown GGML type id {qtype_id}") from None
        if qtype not in GGML_QUANT_SIZES:
            raise ModelLoadError(f"{path}: tensor {name} has unsupported quantization type {qtype.name}")
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if dims[0] % block_size:
            raise ModelLoadError(f"{path}: corrupt GGUF: tensor {name} row {dims[0]} vs block {block_size}")
        nbytes = math.prod(dims) // block_size * type_size
        start = data_start + offset
        if start + nbytes > size:
            raise ModelLoadError(f"{path}: truncated GGUF: tensor {name} ends past the end of the file")
        tensors[name] = TensorInfo(name, tuple(reversed(dims)), qtype, start, nbytes)
    return metadata, tensors


class _Reader:
    """A cursor over the file's bytes; reading past the end raises _Corrupt."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise _Corrupt from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise _Corrupt
        text = self.buf[self.pos : end].decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value_type(self) -> GGUFValueType:
        try:
            return GGUFValueType(self.scalar("<I"))
        except ValueError:
            raise _Corrupt from None

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        value = self.scalar(_SCALAR_FORMATS[vtype])
        # The shortest decimal that rounds to the stored float32 (1e-05, not 9.999999747378752e-06).
        return float(str(np.float32(value))) if vtype == GGUFValueType.FLOAT32 else value

    def array(self) -> list[Any]:
        item_type = self.value_type()
        count = self.scalar("<Q")
        fmt = _SCALAR_FORMATS.get(item_type)
        if fmt is None:  # strings and nested arrays
            return [self.value(item_type) for _ in range(count)]
        dtype = np.dtype(fmt)
        end = self.pos + count * dtype.itemsize
        if end > len(self.buf):
            raise _Corrupt
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).tolist()
        self.pos = end
        return values
