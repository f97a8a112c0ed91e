"""A lean reader of the GGUF container (v2/v3): metadata and tensor index, tensors mmapped.

``gguf.GGUFReader`` builds a numpy memmap object per metadata element, which takes ~2-4 s
on SmolLM2's 49k-token vocabulary; this reader parses the same header with ``struct`` in
tens of milliseconds. Dequantization stays with the ``gguf`` package; :meth:`GGUFFile.rows`
hands out the blocks undecoded, for quantized registrations that carry them over.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import RegistrationError

_MAGIC = b"GGUF"
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the innermost (contiguous) dimension
    qtype: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (numpy/torch) shape."""
        return tuple(reversed(self.dims))


class GGUFFile:
    """Metadata (``fields``) and tensors of a GGUF file; tensor bytes are read through mmap."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._mm
        try:
            if buf[:4] != _MAGIC:
                raise RegistrationError(f"{path} is not a GGUF file (bad magic)")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
            if version not in (2, 3):
                raise RegistrationError(f"{path}: GGUF version {version} is not supported")
            pos = 24
            self.fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key, pos = _string(buf, pos)
                (vtype,) = struct.unpack_from("<I", buf, pos)
                value, pos = _value(buf, pos + 4, vtype)
                self.fields[key] = value
            infos = []
            for _ in range(n_tensors):
                name, pos = _string(buf, pos)
                (n_dims,) = struct.unpack_from("<I", buf, pos)
                dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
                qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
                pos += 4 + 8 * n_dims + 12
                infos.append((name, dims, qtype, offset))
            alignment = int(self.fields.get("general.alignment", 32))
            data_start = -(-pos // alignment) * alignment
            self.tensors: dict[str, GGUFTensor] = {}
            for name, dims, qtype, offset in infos:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
                nbytes = math.prod(dims) // block * type_size
                self.tensors[name] = GGUFTensor(name, tuple(dims), qtype, data_start + offset, nbytes)
                if data_start + offset + nbytes > len(buf):
                    raise RegistrationError(f"{path}: tensor {name} runs past the end of the file")
        except (struct.error, UnicodeDecodeError, ValueError, KeyError) as exc:
            if isinstance(exc, RegistrationError):
                raise
            raise RegistrationError(f"{path} is not a readable GGUF file: {exc}") from None

    def rows(self, name: str) -> np.ndarray:
        """Tensor ``name``'s stored bytes, uint8 (rows, bytes per row): its GGML blocks as they are
        (a read-only view of the mapping)."""
        t = self.tensors[name]
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return raw.reshape(math.prod(t.shape[:-1]), -1)

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32 in row-major shape (a new, writable array)."""
        import gguf
        from gguf import quants

        t = self.tensors[name]
        qtype = gguf.GGMLQuantizationType(t.qtype)
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        if qtype in (
            gguf.GGMLQuantizationType.F32,
            gguf.GGMLQuantizationType.F16,
            gguf.GGMLQuantizationType.BF16,
        ):
            dtype = {0: np.float32, 1: np.float16}.get(t.qtype)
            if dtype is None:  # bfloat16: widen the 16 bits into the top of a float32
                wide = raw.view(np.uint16).astype(np.uint32) << 16
                return wide.view(np.float32).reshape(t.shape)
            return raw.view(dtype).astype(np.float32).reshape(t.shape)
        rows = raw.reshape(*t.shape[:-1], -1)  # (..., bytes per row)
        return np.array(quants.dequantize(rows, qtype), dtype=np.float32)

    def close(self) -> None:
        self._mm.close()


def _string(buf: Any, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _value(buf: Any, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type in _SCALARS:
            fmt = _SCALARS[item_type]
            size = struct.calcsize(fmt)
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", buf, pos))
            return values, pos + size * count
        items = []
        for _ in range(count):
            item, pos = _value(buf, pos, item_type)
            items.append(item)
        return items, pos
    scalar = _SCALARS.get(vtype)
    if scalar is None:
        raise RegistrationError(f"unknown GGUF value type {vtype}")
    (value,) = struct.unpack_from(scalar, buf, pos)
    return value, pos + struct.calcsize(scalar)
