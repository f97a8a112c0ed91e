"""LoRA adapters applied unmerged, per sequence, on a shared base (TIDAL's dynamic components).

An adapter is a PEFT LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``)
registered as its own store entry (:mod:`runtime.adapters`) whose tensors the pool keeps
session-private. The base weights are never touched: a projection ``y = x W^T`` of a target
module becomes ``y + scale * (x A^T) B^T`` for the rows of sequences using the adapter, so
one batch can mix sequences with different adapters and without one (vLLM/Punica style,
here with one small matmul pair per adapter present in the batch instead of a fused kernel).

Store names are the base model's module names with PEFT's ``lora_A`` / ``lora_B`` suffix,
``model.layers.{i}.self_attn.q_proj.lora_A.weight`` (PEFT's ``base_model.model.`` prefix dropped).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the universal alias

from runtime.quant import linear

# Target module -> its path inside a decoder layer.
MODULES: dict[str, str] = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
MAX_RANK = 256  # PEFT adapters in use are rank 4-64; this bounds an outside input
_PEFT_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


class LoraError(ValueError):
    """An adapter that cannot be applied to this base (the message says why)."""


@dataclass(frozen=True, slots=True)
class LoraConfig:
    """The parts of a PEFT ``adapter_config.json`` that the forward pass uses."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.rank <= MAX_RANK:
            raise LoraError(f"adapter_config.json: r must be in 1..{MAX_RANK}, got {self.rank}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise LoraError(f"adapter_config.json: lora_alpha must be a positive number, got {self.alpha}")
        if not self.targets:
            raise LoraError("adapter_config.json: target_modules is empty")
        unknown = sorted(set(self.targets) - set(MODULES))
        if unknown:
            raise LoraError(
                f"adapter_config.json: target_modules {unknown} are not Llama projections "
                f"(supported: {', '.join(MODULES)})"
            )

    @property
    def scale(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @classmethod
    def from_peft(cls, cfg: Any) -> LoraConfig:
        """Validate a parsed ``adapter_config.json``: plain LoRA on Llama projections only."""
        if not isinstance(cfg, dict):
            raise LoraError("adapter_config.json must be a JSON object")
        if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
            raise LoraError(f"adapter_config.json: peft_type {cfg.get('peft_type')!r} is not LORA")
        for flag in ("use_dora", "fan_in_fan_out"):
            if cfg.get(flag):
                raise LoraError(f"adapter_config.json: {flag} is not supported")
        if cfg.get("bias", "none") != "none":
            raise LoraError("adapter_config.json: bias must be 'none'")
        if cfg.get("modules_to_save"):
            raise LoraError("adapter_config.json: modules_to_save is not supported")
        if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
            raise LoraError("adapter_config.json: rank_pattern / alpha_pattern are not supported")
        targets = cfg.get("target_modules")
        if isinstance(targets, str):  # PEFT allows a regex here; we take a plain module name only
            targets = [targets]
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise LoraError("adapter_config.json: target_modules must be a list of module names")
        try:
            rank = int(cfg["r"])
            alpha = float(cfg["lora_alpha"]) if "lora_alpha" in cfg else float(rank)
        except (KeyError, TypeError, ValueError):
            raise LoraError("adapter_config.json: r (and lora_alpha) must be numbers") from None
        return cls(rank, alpha, tuple(sorted(set(targets))), bool(cfg.get("use_rslora", False)))


def canonical_name(peft_name: str) -> str:
    """The store name of a PEFT tensor name (:class:`LoraError` for anything but Llama LoRA A/B)."""
    m = _PEFT_NAME.match(peft_name)
    if m is None or m.group(3) not in MODULES or MODULES[m.group(3)].split(".")[0] != m.group(2):
        raise LoraError(f"adapter tensor {peft_name!r} is not a LoRA A/B weight of a Llama projection")
    return f"model.layers.{m.group(1)}.{m.group(2)}.{m.group(3)}.lora_{m.group(4)}.weight"


def tensor_name(layer: int, module: str, ab: str) -> str:
    return f"model.layers.{layer}.{MODULES[module]}.lora_{ab}.weight"


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One adapter bound to its tensors: per layer, module -> (A (r, in), B (out, r))."""

    key: str  # identity: the registered adapter's id (prefix-cache keys and batches use it)
    scale: float
    layers: tuple[Mapping[str, tuple[torch.Tensor, torch.Tensor]], ...]

    @classmethod
    def bind(
        cls,
        key: str,
        config: LoraConfig,
        tensors: Mapping[str, torch.Tensor],
        num_layers: int,
        shapes: Mapping[str, tuple[int, int]],
    ) -> LoraAdapter:
        """Bind ``tensors`` (store names); ``shapes`` maps a module to its base weight's
        (out, in). :class:`LoraError` for a missing tensor or a shape that does not fit."""
        layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for i in range(num_layers):
            mods: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for module in config.targets:
                a, b = tensors.get(tensor_name(i, module, "A")), tensors.get(tensor_name(i, module, "B"))
                if a is None or b is None:  # PEFT's layers_to_transform: the layer is left as is
                    continue
                out_f, in_f = shapes[module]
                if tuple(a.shape) != (config.rank, in_f) or tuple(b.shape) != (out_f, config.rank):
                    raise LoraError(
                        f"adapter {key}: layer {i} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                        f"this base needs ({config.rank}, {in_f}) and ({out_f}, {config.rank})"
                    )
                mods[module] = (a, b)
            layers.append(mods)
        if not any(layers):
            raise LoraError(f"adapter {key} has no LoRA tensors for this base's layers")
        return cls(key, config.scale, tuple(layers))

    def add_to(
        self, y: torch.Tensor, layer: int, module: str, x: torch.Tensor, rows: torch.Tensor | None
    ) -> None:
        """``y[rows] += scale * (x[rows] A^T) B^T`` in place (every row when ``rows`` is None);
        nothing when the module is not adapted. The scale and the add ride in the second GEMM
        (``addmm_`` / ``index_add_``'s alpha): no pass over the (rows, out) output of its own."""
        ab = self.layers[layer].get(module)
        if ab is None:
            return
        a, b = ab
        if rows is None:
            y.addmm_(F.linear(x.to(a.dtype), a).to(y.dtype), b.t().to(y.dtype), alpha=self.scale)
        else:
            d = F.linear(F.linear(x[rows].to(a.dtype), a), b).to(y.dtype)
            y.index_add_(0, rows, d, alpha=self.scale)


def plain(
    layer: int, module: str, x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The base projection alone (a batch without adapters)."""
    return linear(x, weight, bias)


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """Which rows of a flattened batch use which adapter (rows of no adapter: none listed).

    ``rows`` is None when the group covers every row of the batch (one adapter for all: no
    gather, no scatter)."""

    groups: tuple[tuple[LoraAdapter, torch.Tensor | None], ...]

    @classmethod
    def build(cls, adapters: Sequence[LoraAdapter | None], query_lens: Sequence[int]) -> LoraBatch | None:
        """From one adapter (or None) per sequence and each sequence's new-token count."""
        if all(a is None for a in adapters):
            return None
        if all(a is adapters[0] for a in adapters):
            first = adapters[0]
            assert first is not None
            return cls(((first, None),))
        rows: dict[str, list[int]] = {}
        by_key: dict[str, LoraAdapter] = {}
        start = 0
        for adapter, n in zip(adapters, query_lens, strict=True):
            if adapter is not None:
                by_key[adapter.key] = adapter
                rows.setdefault(adapter.key, []).extend(range(start, start + n))
            start += n
        return cls(tuple((by_key[k], torch.tensor(r)) for k, r in rows.items()))

    def to(self, device: torch.device) -> LoraBatch:
        return LoraBatch(tuple((a, None if r is None else r.to(device)) for a, r in self.groups))

    def project(
        self, layer: int, module: str, x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The base projection plus each group's adapter delta on its own rows."""
        y = linear(x, weight, bias)
        for adapter, rows in self.groups:
            adapter.add_to(y, layer, module, x, rows)
        return y
