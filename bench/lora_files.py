"""Random PEFT LoRA adapter directories, deterministic from a seed (benchmarks and tests).

Written exactly as PEFT saves one: ``adapter_config.json`` and ``adapter_model.safetensors``
with names ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``.
Unlike PEFT's initialisation (B = 0, a no-op until trained) both A and B are random, so the
adapter changes the output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from runtime.models.lora import MODULES


def projection_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out, in) of each Llama projection for a Hugging Face ``config.json`` dict."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv = int(config.get("num_key_value_heads") or heads) * head_dim
    q = heads * head_dim
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def write_adapter(
    directory: Path,
    config: dict[str, Any],
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    std: float = 0.05,
) -> Path:
    """Write a random adapter for a model of Hugging Face ``config`` into ``directory``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    shapes = projection_shapes(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(int(config["num_hidden_layers"])):
        for module in targets:
            out_f, in_f = shapes[module]
            name = f"base_model.model.model.layers.{i}.{MODULES[module]}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * std
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * std
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    peft = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "bias": "none",
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "task_type": "CAUSAL_LM",
    }
    (directory / "adapter_config.json").write_text(json.dumps(peft, indent=1))
    return directory
