"""Registration of models into the model store under ``EMBER_HOME``.

``register(source, dtype)`` turns a GGUF file, a Hugging Face safetensors directory or a
``pkg:`` resource into a registered model: a pool store entry (canonical safetensors in
the requested dtype + manifest with fingerprints), ``config.json``, ``tokenizer.json`` and
``tokenizer_config.json`` (with the chat template), and ``registration.json``.

``dtype`` is ``bfloat16``, ``float32`` or a weight-only quantization, ``int8`` or ``q4``
(:mod:`runtime.quant`): the decoder's projection weights are stored quantized (GGUF blocks that
are already Q8_0 / Q4_1 are carried over exactly), everything else in bfloat16; the store
entry's metadata records the quantization, tensor by tensor.

* Idempotent: a model is named by its source's content hash and dtype; registering the
  same bytes again finds the existing entry.
* Atomic: everything is built in a temporary directory beside the final one and renamed
  into place last; a crash leaves at most a temporary directory, which the next
  registration removes. A file lock serialises concurrent registrations of one model.
* Offline: nothing here touches the network.
* Confined: path sources must lie under the model roots (``EMBER_MODEL_ROOTS``, see
  :mod:`runtime.sources`), and a source's headers are checked
  (:mod:`runtime.model_formats`) before its bytes are hashed.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import RegistrationError
from runtime.model_formats import ModelFormatError, check_format
from runtime.sources import ModelSource, SourceKind, SourceRoots, resolve

DTYPES = ("bfloat16", "float32", "int8", "q4")
QUANTIZED = ("int8", "q4")  # weight-only: runtime.quant
_ID_SUFFIX = {"bfloat16": "bf16", "float32": "fp32", "int8": "int8", "q4": "q4"}
_STORE_DIR = "store"
_RECORD = "registration.json"
_PROFILE = "profile.json"
PROFILE_BLOCK_SIZE = 16  # tokens per KV block
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True, slots=True)
class RegisteredModel:
    """A model in the store: its id, directory, config and registration record."""

    model_id: str
    directory: Path
    config: dict[str, Any]
    record: dict[str, Any]

    @property
    def store_path(self) -> Path:
        return self.directory / _STORE_DIR

    def profile(self, device_kind: str = "cpu") -> dict[str, Any]:
        """The materialized profile of this model on ``device_kind`` (KV geometry, warm-up)."""
        path = self.directory / _PROFILE
        if not path.is_file():
            raise RegistrationError(
                f"{self.model_id} has no profile.json; delete {self.directory} and register again"
            )
        data = json.loads(path.read_text())
        if device_kind not in data:
            raise RegistrationError(f"{self.model_id} has no materialized profile for {device_kind!r}")
        profile: dict[str, Any] = data[device_kind]
        return profile

    def manifest(self) -> Any:
        """The pool manifest (a :class:`gpu_pool.manifest.Manifest`)."""
        from gpu_pool import store

        return store.read(self.store_path)


def ember_home() -> Path:
    """``EMBER_HOME`` (default ``~/.ember``)."""
    return Path(os.environ.get("EMBER_HOME") or Path.home() / ".ember").expanduser()


def models_dir(home: Path | None = None) -> Path:
    return (home or ember_home()) / "models"


def register(
    source: str,
    dtype: str = "bfloat16",
    home: Path | None = None,
    progress: bool = False,
    roots: SourceRoots | None = None,
) -> RegisteredModel:
    """Register ``source`` in ``dtype`` (idempotent); returns the registered model.

    ``roots`` bounds path sources (default: ``EMBER_MODEL_ROOTS``); ``pkg:`` is always allowed.
    """
    if dtype not in DTYPES:
        raise RegistrationError(f"dtype {dtype!r} is not supported (choose from {', '.join(DTYPES)})")
    root = models_dir(home)
    root.mkdir(parents=True, exist_ok=True)
    src = resolve(source, roots)
    check_format(src)  # before hashing: a wrong file fails in microseconds, not after reading it all
    content_hash = src.content_hash()
    model_id = f"{_slug(src)}-{content_hash[:12]}-{_ID_SUFFIX[dtype]}"
    final = root / model_id
    with file_lock(root / f".lock-{model_id}"):
        if (final / _RECORD).is_file():
            model = load(final)
            ensure_time_table(model)  # registered before time tables were materialized
            return model
        with staged(root, model_id) as tmp:
            start = time.perf_counter()
            config = _build(src, dtype, tmp, model_id, progress)
            record = {
                "version": 1,
                "model_id": model_id,
                "source": src.text,
                "source_kind": src.kind.value,
                "source_path": str(src.path),
                "content_hash": content_hash,
                "dtype": dtype,
                "quantization": dtype if dtype in QUANTIZED else None,
                "architecture": config["architectures"][0],
                "access_order": "traced",  # the store entry's tensor order (runtime.access_order)
                "seconds": round(time.perf_counter() - start, 3),
            }
            (tmp / _RECORD).write_text(json.dumps(record, indent=1))
    return load(final)


def ensure_time_table(model: RegisteredModel) -> None:
    """Materialize the CPU time table (runtime.iteration_profile) of a model registered without
    one, from its store entry; the profile is replaced atomically (readers see old or new)."""
    path = model.directory / _PROFILE
    try:
        profile = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return  # a broken profile: load() / profile() report it
    cpu = profile.get("cpu")
    if not isinstance(cpu, dict) or "time_table" in cpu:
        return
    import torch
    from safetensors.torch import load_file

    from runtime.iteration_profile import measure_time_table
    from runtime.models.llama import LlamaConfig, LlamaModel

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted({e.file for e in model.manifest().tensors}):
        tensors.update(load_file(file))
    llama = LlamaModel(LlamaConfig.from_hf(model.config), tensors)
    table = measure_time_table(llama, getattr(torch, cpu["kv_dtype"]), int(cpu["block_size"]))
    cpu["time_table"] = table.to_json()
    tmp = path.with_name(f"{_TMP_PREFIX}{_PROFILE}-{os.getpid()}")
    tmp.write_text(json.dumps(profile, indent=1))
    os.replace(tmp, path)


def load(directory: Path) -> RegisteredModel:
    """Open a registered model's directory."""
    try:
        record = json.loads((directory / _RECORD).read_text())
        config = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RegistrationError(f"{directory} is not a complete registered model: {exc}") from None
    return RegisteredModel(record["model_id"], directory, config, record)


def list_models(home: Path | None = None) -> list[RegisteredModel]:
    """Every complete registered model."""
    root = models_dir(home)
    if not root.is_dir():
        return []
    return [load(d) for d in sorted(root.iterdir()) if (d / _RECORD).is_file()]


def _build(src: ModelSource, dtype: str, out: Path, model_id: str, progress: bool) -> dict[str, Any]:
    import torch

    from gpu_pool import store
    from runtime.access_order import ACCESS_ORDER_VERSION, ordered, trace_access_order
    from runtime.gguf_import import GGMLBlocks
    from runtime.store_weights import StoreWeights

    weights = StoreWeights(dtype)
    if src.kind is SourceKind.GGUF:
        from runtime.gguf_import import read_gguf, write_hf_metadata

        model = read_gguf(src.path)
        try:
            items = model.tensors_or_blocks(weights.carry)
            for name, array in _progress(items, len(model.tensor_names), progress, model_id):
                weights.add(name, array if isinstance(array, GGMLBlocks) else torch.from_numpy(array))
            write_hf_metadata(model, out)
        finally:
            model.close()
        config = dict(model.config)
    else:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        config = json.loads((src.path / "config.json").read_text())
        files = sorted(src.path.glob("*.safetensors"))
        if not files:
            raise RegistrationError(f"{src.path} has no *.safetensors files")
        for file in _progress(iter(files), len(files), progress, model_id):
            try:
                loaded = load_file(str(file))
            except SafetensorError as exc:  # check_format passed, yet the library disagrees
                raise ModelFormatError(f"{file.name}: {exc}") from None
            for name, t in loaded.items():
                weights.add(name, t)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (src.path / name).is_file():
                shutil.copyfile(src.path / name, out / name)
        if not (out / "tokenizer.json").is_file():
            raise RegistrationError(f"{src.path} has no tokenizer.json")
    weights.quantize_head()
    config["torch_dtype"] = str(weights.float_dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    profile = materialize_profile(config, weights.tensors, dtype)
    (out / _PROFILE).write_text(json.dumps(profile, indent=1))
    # TIDAL: the entry lists its tensors in the order the forward touches them, which a
    # (progressive) acquire loads them in.
    order = trace_access_order(config, weights.tensors)
    metadata = weights.metadata()
    metadata["access_order"] = {"version": ACCESS_ORDER_VERSION, "traced": True, "tensors": len(order)}
    store.write(out / _STORE_DIR, ordered(weights.tensors, order), model_id=model_id, metadata=metadata)
    return config


def materialize_profile(config: dict[str, Any], tensors: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Medusa §6: what an instance start would otherwise measure, recorded once per device kind.

    KV geometry (bytes per block, blocks a request can need), the weights' resident bytes (an
    int8 / q4 model leaves that much more of an arena to KV: ``kv_blocks_per_gib``, blocks that
    fit in a 1 GiB arena beside one copy of the weights) and warm-up timings of a short prefill
    and decode, so an engine start runs no profiling pass, and LLM-Mesh's iteration time tables
    (:mod:`runtime.iteration_profile`). CPU is profiled here; a GPU kind is added when the model
    is first placed on one.
    """
    import torch

    from runtime.iteration_profile import measure_time_table
    from runtime.models.llama import Batch, LlamaConfig, LlamaModel

    cfg = LlamaConfig.from_hf(config)
    kv_dtype = "bfloat16" if dtype in QUANTIZED else dtype  # activations and KV of a quantized model
    torch_dtype = getattr(torch, kv_dtype)
    block_size = PROFILE_BLOCK_SIZE
    raw = cfg.kv_block_bytes(block_size, torch_dtype)
    block_bytes = -(-raw // 256) * 256
    weight_bytes = sum(int(t.nbytes) for t in tensors.values())
    prompt = min(32, cfg.max_position_embeddings - 8)
    model = LlamaModel(cfg, tensors)
    nb = -(-(prompt + 8) // block_size)
    kv = torch.zeros(nb, *cfg.kv_block_shape(block_size), dtype=torch_dtype)
    table = torch.arange(nb)[None, :]

    def step(start: int, n: int) -> float:
        pos = torch.arange(start, start + n)
        t0 = time.perf_counter()
        model.forward(Batch(pos % cfg.vocab_size, pos, pos, [n], [start + n], table), kv)
        return time.perf_counter() - t0

    prefill = step(0, prompt)
    decode = [step(prompt + i, 1) for i in range(8)]
    times = measure_time_table(model, torch_dtype, block_size)
    return {
        "version": 1,
        "cpu": {
            "block_size": block_size,
            "kv_dtype": kv_dtype,
            "kv_block_bytes": block_bytes,
            "kv_bytes_per_token": raw // block_size,
            "max_blocks_per_request": -(-cfg.max_position_embeddings // block_size),
            "weights_dtype": dtype,
            "weight_bytes": weight_bytes,
            "kv_blocks_per_gib": max(0, ((1 << 30) - weight_bytes) // block_bytes),
            "warmup": {
                "prefill_tokens": prompt,
                "prefill_ms": round(prefill * 1e3, 3),
                "decode_ms_per_token": round(sorted(decode)[len(decode) // 2] * 1e3, 3),
                "threads": torch.get_num_threads(),
            },
            # LLM-Mesh's prefill / decode time tables (runtime.iteration_profile).
            "time_table": times.to_json(),
        },
    }


def _progress(items: Iterator[Any], total: int, enabled: bool, what: str) -> Iterator[Any]:
    if not enabled:
        return items
    from tqdm import tqdm

    return iter(tqdm(items, total=total, desc=f"registering {what}", unit="tensor", leave=False))


def _slug(src: ModelSource) -> str:
    stem = src.path.stem if src.path.is_file() else src.path.name
    return re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")[:40] or "model"


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@contextmanager
def staged(root: Path, entry_id: str) -> Iterator[Path]:
    """A fresh directory to build entry ``entry_id`` of ``root`` in (a crashed registration's
    half-built ones are removed first); when the block ends it is synced and renamed into place
    at once, or removed if the block failed. Hold the entry's :func:`file_lock`."""
    _remove_stale_temporaries(root, entry_id)
    tmp = root / f"{_TMP_PREFIX}{entry_id}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        os.rename(tmp, root / entry_id)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_stale_temporaries(root: Path, model_id: str) -> None:
    """Half-built directories of this model left by a crashed or killed registration.

    Safe under the model's lock: no live registration of this model is writing one.
    """
    for entry in root.glob(f"{_TMP_PREFIX}{model_id}-*"):
        shutil.rmtree(entry, ignore_errors=True)


def fsync_tree(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
