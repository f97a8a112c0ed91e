"""Registration of LoRA adapters (a function spec's ``model.adapters``) into the model store.

An adapter is registered like a model but on its own (``EMBER_HOME/models/adapters/<id>``, under
``models/`` so a sandboxed worker can read it as it reads models): a pool
store entry whose tensors are all marked dynamic (``static: False``), so the pool keeps each
instance's copy session-private and drops it with the session, while the base model it adapts
stays one shared static entry (TIDAL: the template keeps the static part, the dynamic part is
loaded per invocation). Two functions on one base with different adapters hold the base once.

Like :func:`runtime.registry.register`: idempotent (named by content hash and dtype), atomic
(built beside, renamed last), confined (:func:`runtime.sources.resolve_adapter`), headers
checked before any byte is hashed, offline.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import RegistrationError
from runtime.model_formats import ModelFormatError, check_safetensors
from runtime.models.lora import LoraAdapter, LoraConfig, LoraError, canonical_name
from runtime.registry import file_lock, models_dir, staged
from runtime.sources import SourceRoots, resolve_adapter

_RECORD = "registration.json"
_STORE_DIR = "store"
_MAX_CONFIG_BYTES = 1 << 20
_MAX_TENSORS = 4096  # LoRA A/B of 7 projections x 256 layers is 3584
DTYPES = {"bfloat16": "bf16", "float32": "fp32"}  # the base's activation dtype


@dataclass(frozen=True, slots=True)
class RegisteredAdapter:
    """An adapter in the store: its id, directory, LoRA config and registration record."""

    adapter_id: str
    directory: Path
    config: LoraConfig
    record: dict[str, Any]

    @property
    def store_path(self) -> Path:
        return self.directory / _STORE_DIR

    def manifest(self) -> Any:
        """The pool manifest (a :class:`gpu_pool.manifest.Manifest`, every tensor dynamic)."""
        from gpu_pool import store

        return store.read(self.store_path)

    def bind(self, tensors: dict[str, Any], base: Any) -> LoraAdapter:
        """Bind the adapter's tensors (views) to ``base`` (a :class:`runtime.models.llama.LlamaModel`);
        :class:`LoraError` when the shapes do not fit the base."""
        cfg = base.config
        return LoraAdapter.bind(self.adapter_id, self.config, tensors, cfg.num_layers, _shapes(cfg))

    def check_fits(self, base_config: dict[str, Any]) -> None:
        """:class:`LoraError` unless the adapter binds to a base of Hugging Face ``base_config``
        (its registration record's config): checked at deploy, from the manifest's shapes, so
        a function whose every instance would fail to start is refused at once."""
        import torch

        from runtime.models.llama import LlamaConfig

        try:
            cfg = LlamaConfig.from_hf(base_config)
        except (KeyError, TypeError, ValueError) as exc:
            raise LoraError(f"the base model's config cannot take an adapter: {exc}") from None
        meta = {t.name: torch.empty(t.shape, device="meta") for t in self.manifest().tensors}
        LoraAdapter.bind(self.adapter_id, self.config, meta, cfg.num_layers, _shapes(cfg))


def _shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """Each target module's base weight (out, in) in a :class:`runtime.models.llama.LlamaConfig`."""
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "q_proj": (q_out, cfg.hidden_size),
        "k_proj": (kv_out, cfg.hidden_size),
        "v_proj": (kv_out, cfg.hidden_size),
        "o_proj": (cfg.hidden_size, q_out),
        "gate_proj": (cfg.intermediate_size, cfg.hidden_size),
        "up_proj": (cfg.intermediate_size, cfg.hidden_size),
        "down_proj": (cfg.hidden_size, cfg.intermediate_size),
    }


def adapters_dir(home: Path | None = None) -> Path:
    return models_dir(home) / "adapters"


def register_adapter(
    source: str,
    dtype: str = "bfloat16",
    home: Path | None = None,
    roots: SourceRoots | None = None,
    base_config: dict[str, Any] | None = None,
) -> RegisteredAdapter:
    """Register the PEFT LoRA directory ``source`` with tensors in ``dtype`` (the base model's
    activation dtype: ``bfloat16`` for bf16, int8 and q4 bases, ``float32`` for fp32 ones).
    With ``base_config`` (the base's Hugging Face config), :class:`ModelFormatError` unless the
    adapter fits that base (:meth:`RegisteredAdapter.check_fits`)."""
    adapter = _register(source, dtype, home, roots)
    if base_config is not None:
        try:
            adapter.check_fits(base_config)
        except LoraError as exc:
            raise ModelFormatError(str(exc)) from None
    return adapter


def _register(source: str, dtype: str, home: Path | None, roots: SourceRoots | None) -> RegisteredAdapter:
    if dtype not in DTYPES:
        raise RegistrationError(f"adapter dtype {dtype!r} is not supported (choose from {', '.join(DTYPES)})")
    src = resolve_adapter(source, roots)
    config_file, weights_file = src.path / "adapter_config.json", src.path / "adapter_model.safetensors"
    if config_file.stat().st_size > _MAX_CONFIG_BYTES:
        raise ModelFormatError(f"adapter_config.json is larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        config = LoraConfig.from_peft(json.loads(config_file.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelFormatError("adapter_config.json is not valid JSON") from None
    except LoraError as exc:
        raise ModelFormatError(str(exc)) from None
    check_safetensors(weights_file)  # before hashing: a wrong file fails at once
    content_hash = src.content_hash()
    slug = re.sub(r"[^a-z0-9]+", "-", src.path.name.lower()).strip("-")[:40] or "adapter"
    adapter_id = f"{slug}-{content_hash[:12]}-lora-{DTYPES[dtype]}"
    root = adapters_dir(home)
    root.mkdir(parents=True, exist_ok=True)
    final = root / adapter_id
    with file_lock(root / f".lock-{adapter_id}"):
        if (final / _RECORD).is_file():
            return load_adapter(final)
        with staged(root, adapter_id) as tmp:
            _build(weights_file, dtype, config, tmp, adapter_id)
            shutil.copyfile(config_file, tmp / "adapter_config.json")
            record = {
                "version": 1,
                "adapter_id": adapter_id,
                "source": src.text,
                "source_path": str(src.path),
                "content_hash": content_hash,
                "dtype": dtype,
                "rank": config.rank,
                "targets": list(config.targets),
            }
            (tmp / _RECORD).write_text(json.dumps(record, indent=1))
    return load_adapter(final)


def _build(weights_file: Path, dtype: str, config: LoraConfig, out: Path, adapter_id: str) -> None:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from gpu_pool import store

    try:
        loaded = load_file(str(weights_file))
    except SafetensorError as exc:
        raise ModelFormatError(f"adapter_model.safetensors: {exc}") from None
    if len(loaded) > _MAX_TENSORS:
        raise ModelFormatError(f"adapter_model.safetensors has more than {_MAX_TENSORS} tensors")
    tensors: dict[str, torch.Tensor] = {}
    try:
        for name, t in loaded.items():
            canonical = canonical_name(name)
            if canonical.split(".")[-3] not in config.targets:
                raise LoraError(f"adapter tensor {name!r} is for a module outside target_modules")
            tensors[canonical] = t.to(getattr(torch, dtype))
    except LoraError as exc:
        raise ModelFormatError(str(exc)) from None
    # Access order (the layer loop's): loading follows the manifest's order.
    ordered = dict(sorted(tensors.items(), key=lambda kv: _order(kv[0])))
    store.write(out / _STORE_DIR, ordered, model_id=adapter_id, static=False)


def _order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return int(parts[2]), ".".join(parts[3:])


def load_adapter(directory: Path) -> RegisteredAdapter:
    """Open a registered adapter's directory."""
    try:
        record = json.loads((directory / _RECORD).read_text())
        config = LoraConfig.from_peft(json.loads((directory / "adapter_config.json").read_text()))
    except (OSError, json.JSONDecodeError, LoraError) as exc:
        raise RegistrationError(f"{directory} is not a complete registered adapter: {exc}") from None
    return RegisteredAdapter(record["adapter_id"], directory, config, record)
