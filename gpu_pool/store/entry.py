"""The model store: canonical, mmap-able model files plus their manifest.

A store entry is a directory holding ``tensors.safetensors`` (the bytes) and
``manifest.json`` (the versioned manifest with fingerprints and byte offsets into the
safetensors file, whose name is stored relative to the entry so the entry can be moved).
:func:`write` builds one from named torch tensors; registration of real
models and the tests both go through it; the file holds the tensors' bytes in the order given
(registration's is the model's traced access order). Writing is atomic: the entry appears complete
under its final name or not at all.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpu_pool.errors import ManifestError
from gpu_pool.manifest import Manifest, TensorEntry
from gpu_pool.store.fingerprint import fingerprint

if TYPE_CHECKING:
    import torch

TENSORS_FILE = "tensors.safetensors"
DATA_ALIGN = 4096  # bytes: where a store file's tensor data starts
MANIFEST_FILE = "manifest.json"
_METADATA = "metadata"  # manifest.json key of write()'s metadata (Manifest.from_dict ignores it)

# safetensors dtype tags -> manifest dtype names.
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def write(
    path: str | os.PathLike[str],
    tensors: dict[str, torch.Tensor],
    model_id: str | None = None,
    latency_sensitivity: float = 1.0,
    metadata: dict[str, Any] | None = None,
    static: bool = True,
) -> Manifest:
    """Write a store entry at ``path`` (a directory) from named tensors and return its manifest.

    The directory must not exist yet; it is created atomically (written beside it under a
    temporary name, then renamed). ``model_id`` defaults to the directory name. ``metadata``
    (JSON-able, e.g. the model's quantization) is kept in ``manifest.json`` beside the tensor
    list for :func:`read_metadata`; the pool never reads it (it sees tensors only). ``static``
    false marks every tensor dynamic (a LoRA adapter): the pool keeps it private to the session
    that acquires it, never shared.
    """
    from safetensors.torch import save_file

    final = Path(path).absolute()
    if final.exists():
        raise ManifestError(f"store entry {final} already exists")
    if not tensors:
        raise ManifestError("a store entry needs at least one tensor")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        contiguous = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
        if not _save_in_order(contiguous, tmp / TENSORS_FILE):
            save_file(contiguous, str(tmp / TENSORS_FILE))
        manifest = _manifest_from_safetensors(
            tmp / TENSORS_FILE,
            model_id or final.name,
            latency_sensitivity,
            recorded_path=final / TENSORS_FILE,
            order=list(tensors),
            static=static,
        )
        document = _relative(manifest.to_dict())
        if metadata:
            document[_METADATA] = metadata
        (tmp / MANIFEST_FILE).write_text(json.dumps(document, indent=1))
        _fsync_dir_tree(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _save_in_order(tensors: dict[str, torch.Tensor], file: Path) -> bool:
    """Write a safetensors file whose data lies in ``tensors``' order (``save_file`` sorts by
    dtype and name). Registration passes the model's access order (TIDAL: the layout follows
    it, so a layer's bytes are one extent and a load in that order reads the file forward).
    Returns False, writing nothing, when a tensor would start at an offset that is not a
    multiple of its element size, or has a dtype without a safetensors tag."""
    import torch

    tags = {torch_name: tag for tag, torch_name in _SAFETENSORS_DTYPES.items()}
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        tag = tags.get(str(t.dtype).removeprefix("torch."))
        if tag is None or offset % t.element_size():
            return False
        size = t.numel() * t.element_size()
        header[name] = {"dtype": tag, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    # The data starts on a 4 KiB boundary (safetensors allows a header padded with spaces):
    # tensor bytes then sit block-aligned in the file, as direct I/O reads them
    # (gpu_pool.arena.direct_read).
    raw += b" " * (-(8 + len(raw)) % DATA_ALIGN)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
    return True


def _manifest_json(path: str | os.PathLike[str]) -> tuple[Path, Any]:
    """(the manifest file, its parsed JSON) of the store entry at ``path``; :class:`ManifestError`
    when it is missing or not JSON."""
    file = Path(path).absolute() / MANIFEST_FILE
    try:
        return file, json.loads(file.read_text())
    except FileNotFoundError:
        raise ManifestError(f"no store entry at {path} (missing {MANIFEST_FILE})") from None
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{file} is not valid JSON: {exc}") from None


def read(path: str | os.PathLike[str]) -> Manifest:
    """Read the manifest of the store entry at ``path``."""
    entry = Path(path).absolute()
    _, data = _manifest_json(path)
    # File names are stored relative to the entry, so an entry can be renamed or moved whole.
    if isinstance(data, dict) and isinstance(data.get("tensors"), list):
        for t in data["tensors"]:
            if isinstance(t, dict) and isinstance(t.get("file"), str):
                t["file"] = str(entry / t["file"])
    return Manifest.from_dict(data)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``metadata`` the store entry at ``path`` was written with (``{}`` if none)."""
    file, data = _manifest_json(path)
    metadata = data.get(_METADATA, {}) if isinstance(data, dict) else None
    if not isinstance(metadata, dict):
        raise ManifestError(f"{file}: {_METADATA!r} must be a JSON object")
    return metadata


def _relative(data: dict[str, Any]) -> dict[str, Any]:
    for t in data["tensors"]:
        t["file"] = Path(t["file"]).name
    return data


def verify(manifest: Manifest) -> list[str]:
    """Names of tensors whose bytes in the store no longer match their fingerprint."""
    bad: list[str] = []
    for entry in manifest.tensors:
        with open(entry.file, "rb") as f:
            f.seek(entry.offset)
            data = f.read(entry.nbytes)
        if len(data) != entry.nbytes or fingerprint(entry.dtype, entry.shape, data) != entry.fingerprint:
            bad.append(entry.name)
    return bad


def _manifest_from_safetensors(
    file: Path,
    model_id: str,
    latency_sensitivity: float,
    recorded_path: Path,
    order: list[str],
    static: bool = True,
) -> Manifest:
    """Fingerprint every tensor of a safetensors file and record its absolute byte offset."""
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data_start = 8 + header_len
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else None
        try:
            entries: dict[str, TensorEntry] = {}
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise ManifestError(f"tensor {name!r}: unsupported safetensors dtype {info['dtype']}")
                begin, end = info["data_offsets"]
                shape = tuple(int(d) for d in info["shape"])
                assert mm is not None
                view = memoryview(mm)[data_start + begin : data_start + end]
                try:
                    fp = fingerprint(dtype, shape, view)
                finally:
                    view.release()
                entries[name] = TensorEntry(
                    name=name,
                    dtype=dtype,
                    shape=shape,
                    nbytes=end - begin,
                    fingerprint=fp,
                    file=str(recorded_path),
                    offset=data_start + begin,
                    static=static,
                )
        finally:
            if mm is not None:
                mm.close()
    assert set(entries) == set(order)
    # Keep the caller's order: it is the model's access order, which loading follows.
    return Manifest(model_id, tuple(entries[n] for n in order), latency_sensitivity)


def _fsync_dir_tree(directory: Path) -> None:
    for child in directory.iterdir():
        with open(child, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
