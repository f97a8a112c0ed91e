"""Cheap checks of a model source's container format, run before anything reads it whole.

Registration hashes every byte of a source and then parses it; a file that is not what its
name says should fail fast, with a typed error naming the problem, not after a multi-GB
hash or as an exception from deep inside a parser. Only headers are read here:

* GGUF: the ``GGUF`` magic, a supported version (2 or 3) and bounded tensor and metadata
  counts (the full header is parsed later by :mod:`runtime.gguf_file`, which bounds every
  read by the file's size);
* safetensors: each ``*.safetensors`` file's 8-byte little-endian header length (bounded,
  inside the file), a JSON object header, and every tensor's ``data_offsets`` inside the
  data section and consistent with its dtype and shape; ``config.json`` a JSON object.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from runtime.errors import RegistrationError
from runtime.sources import ModelSource, SourceKind

_GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)
_GGUF_MAX_COUNT = 1 << 20  # tensors or metadata entries in one file (real models: < 10^4)
_ST_MAX_HEADER = 100 << 20  # bytes; the safetensors library's own limit
_ST_MAX_DIMS = 16
_MAX_CONFIG_BYTES = 1 << 20
# Bytes per element of the safetensors dtypes (sub-byte ones are rejected: torch cannot load them).
_ST_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
    "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip


class ModelFormatError(RegistrationError):
    """A source's bytes are not the format it claims (bad magic, bad header)."""

    code = "invalid_model_format"


def check_format(src: ModelSource) -> None:
    """Raise :class:`ModelFormatError` unless ``src``'s headers are well formed."""
    if src.kind is SourceKind.GGUF:
        check_gguf(src.path)
        return
    check_config(src.path / "config.json")
    files = sorted(src.path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{src.text}: the directory has no *.safetensors files")
    for file in files:
        check_safetensors(file)


def check_gguf(path: Path) -> None:
    """The fixed GGUF header: magic, version, tensor and metadata counts."""
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:4] != _GGUF_MAGIC:
        raise ModelFormatError(f"{path.name} is not a GGUF file (bad magic)")
    if len(head) < 24:
        raise ModelFormatError(f"{path.name}: the GGUF header is truncated")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
    if version not in _GGUF_VERSIONS:
        raise ModelFormatError(f"{path.name}: GGUF version {version} is not supported")
    if n_tensors > _GGUF_MAX_COUNT or n_kv > _GGUF_MAX_COUNT:
        raise ModelFormatError(
            f"{path.name}: the GGUF header claims {n_tensors} tensors and {n_kv} metadata entries "
            f"(at most {_GGUF_MAX_COUNT} each)"
        )


def check_config(path: Path) -> None:
    """``config.json``: a JSON object of bounded size."""
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise ModelFormatError(f"config.json is larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ModelFormatError(f"config.json is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelFormatError("config.json is not a JSON object")


def check_safetensors(path: Path) -> None:
    """A safetensors file's header: length, JSON, and every tensor's byte range."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ModelFormatError(f"{path.name}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", prefix)  # u64; a "negative" i64 is a huge u64 here
        if length > _ST_MAX_HEADER or length > size - 8:
            raise ModelFormatError(
                f"{path.name}: safetensors header length {length} is out of bounds "
                f"(file {size} bytes, at most {_ST_MAX_HEADER})"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise ModelFormatError(f"{path.name}: the safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path.name}: the safetensors header is not a JSON object")
    data_bytes = size - 8 - length
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise ModelFormatError(f"{path.name}: __metadata__ must map strings to strings")
            continue
        _check_tensor_entry(path.name, name, entry, data_bytes)


def _check_tensor_entry(file: str, name: str, entry: Any, data_bytes: int) -> None:
    if not isinstance(entry, dict):
        raise ModelFormatError(f"{file}: tensor {name!r} has no header entry object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _ST_DTYPE_BYTES:
        raise ModelFormatError(f"{file}: tensor {name!r} has unsupported dtype {dtype!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > _ST_MAX_DIMS
        or not all(type(d) is int and d >= 0 for d in shape)
    ):
        raise ModelFormatError(f"{file}: tensor {name!r} has a bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_bytes
    ):
        raise ModelFormatError(
            f"{file}: tensor {name!r} data_offsets {offsets!r} are outside the data ({data_bytes} bytes)"
        )
    if offsets[1] - offsets[0] != math.prod(shape) * _ST_DTYPE_BYTES[dtype]:
        raise ModelFormatError(f"{file}: tensor {name!r} data_offsets do not match its dtype and shape")
