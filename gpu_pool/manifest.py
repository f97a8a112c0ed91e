"""Manifests: the model-agnostic tensor lists the pool works from.

A manifest names a model and lists its tensors (name, dtype, shape, byte count, content
fingerprint, and where the bytes sit in the model store). The pool never sees an
architecture, only manifests. The encoding is an explicit, versioned dict (msgpack/JSON
friendly); never pickle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack

from gpu_pool.errors import ManifestError

MANIFEST_VERSION = 1

# Bytes per element of every dtype a manifest may carry (torch names without the prefix).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a manifest.

    ``file`` is the store file holding the bytes (absolute path) and ``offset`` the byte
    offset of the first element in it. ``static`` tensors may be shared and kept resident;
    dynamic ones (per-request weights such as LoRA adapters) are not pooled as static.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    fingerprint: str
    file: str
    offset: int
    static: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            raise ManifestError("tensor name must not be empty")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ManifestError(f"tensor {self.name!r}: unsupported dtype {self.dtype!r}")
        if any(d < 0 for d in self.shape):
            raise ManifestError(f"tensor {self.name!r}: negative dimension in shape {self.shape}")
        expected = math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]
        if self.nbytes != expected:
            raise ManifestError(
                f"tensor {self.name!r}: nbytes={self.nbytes} but dtype {self.dtype} and shape "
                f"{self.shape} need {expected}"
            )
        if self.offset < 0:
            raise ManifestError(f"tensor {self.name!r}: negative store offset {self.offset}")
        if len(self.fingerprint) != 32:
            raise ManifestError(f"tensor {self.name!r}: fingerprint must be 32 hex characters")

    def to_dict(self) -> dict[str, Any]:
        """Wire form of this entry."""
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "fingerprint": self.fingerprint,
            "file": self.file,
            "offset": self.offset,
            "static": self.static,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorEntry:
        """Parse the wire form, naming the field that is wrong."""
        try:
            return cls(
                name=str(data["name"]),
                dtype=str(data["dtype"]),
                shape=tuple(int(d) for d in data["shape"]),
                nbytes=int(data["nbytes"]),
                fingerprint=str(data["fingerprint"]),
                file=str(data["file"]),
                offset=int(data["offset"]),
                static=bool(data.get("static", True)),
            )
        except KeyError as exc:
            raise ManifestError(f"tensor entry is missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ManifestError):
                raise
            raise ManifestError(f"tensor entry is malformed: {exc}") from None


@dataclass(frozen=True, slots=True)
class Manifest:
    """A model's tensors, as the pool sees it."""

    model_id: str
    tensors: tuple[TensorEntry, ...]
    latency_sensitivity: float = 1.0  # Tangram alpha_m, from the function spec
    _by_name: dict[str, TensorEntry] = field(init=False, repr=False, compare=False)
    _encoded: list[bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ManifestError("model_id must not be empty")
        if not self.latency_sensitivity > 0:
            raise ManifestError("latency_sensitivity must be > 0")
        by_name = {t.name: t for t in self.tensors}
        if len(by_name) != len(self.tensors):
            raise ManifestError(f"manifest {self.model_id!r} has duplicate tensor names")
        object.__setattr__(self, "_by_name", by_name)
        object.__setattr__(self, "_encoded", [])

    def __getitem__(self, name: str) -> TensorEntry:
        return self._by_name[name]

    @property
    def nbytes(self) -> int:
        """Total bytes of all tensors (shared ones counted once per entry)."""
        return sum(t.nbytes for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        """Versioned wire form."""
        return {
            "version": MANIFEST_VERSION,
            "model_id": self.model_id,
            "latency_sensitivity": self.latency_sensitivity,
            "tensors": [t.to_dict() for t in self.tensors],
        }

    def encoded(self) -> bytes:
        """The msgpack encoding of :meth:`to_dict`, computed once (the acquire hot path sends it)."""
        if not self._encoded:
            self._encoded.append(msgpack.packb(self.to_dict(), use_bin_type=True))
        return self._encoded[0]

    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Parse the versioned wire form."""
        if not isinstance(data, dict):
            raise ManifestError("manifest must be a mapping")
        if data.get("version") != MANIFEST_VERSION:
            raise ManifestError(f"unsupported manifest version {data.get('version')!r}")
        tensors = data.get("tensors")
        if not isinstance(tensors, list):
            raise ManifestError("manifest field 'tensors' must be a list")
        try:
            alpha = float(data.get("latency_sensitivity", 1.0))
        except (TypeError, ValueError):
            raise ManifestError("manifest field 'latency_sensitivity' must be a number") from None
        return cls(
            model_id=str(data.get("model_id", "")),
            tensors=tuple(TensorEntry.from_dict(t) if isinstance(t, dict) else _bad_entry() for t in tensors),
            latency_sensitivity=alpha,
        )

    def with_latency_sensitivity(self, alpha: float) -> Manifest:
        """Copy with a different alpha_m (the function spec sets it at deploy time)."""
        return Manifest(self.model_id, self.tensors, alpha)


def _bad_entry() -> TensorEntry:
    raise ManifestError("every tensor entry must be a mapping")
