"""The zoo's generated weights: random Llamas from a seed and "fine-tuned" copies of a base.

Everything written here is a pure function of its recipe (shape, seed, the base's registered
bytes): the same recipe gives byte-identical files, so registration (named by content hash)
finds a model again instead of registering a new one, and two machines build the same zoo.

* :func:`write_random_llama`: a Hugging Face layout directory (``config.json``,
  ``model.safetensors``, SmolLM2's ``tokenizer.json`` / ``tokenizer_config.json``) of a
  Llama-shaped model whose weights are N(0, 0.02) (the usual Llama init, so logits stay finite
  through any depth) and whose RMSNorm weights are 1. Each tensor is drawn from its own stream
  (seed, tensor name) and streamed into the file, so memory stays at one tensor however big the
  model is.
* :func:`write_finetune`: the registered base's store tensors exported as a safetensors
  directory (as ``tests/runtime/test_registry.py`` does), with :func:`perturbed_names` (two
  layers' MLP projections and one attention projection, chosen from the seed) nudged by seeded
  noise; every other tensor keeps the base's bytes, hence its fingerprint.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

INIT_STD = 0.02  # Llama's initializer_range
FINETUNE_STD = 0.05  # the perturbation, relative to the tensor's own standard deviation
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """A Llama-style decoder's geometry (Hugging Face names in :meth:`config`)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = True
    max_positions: int = 4096
    rope_theta: float = 500000.0

    def __post_init__(self) -> None:
        for field in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab", "max_positions"):
            if getattr(self, field) <= 0:
                raise ValueError(f"LlamaShape.{field} must be positive")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError("hidden must divide into heads, and heads into kv_heads groups")
        if (self.hidden // self.heads) % 2:
            raise ValueError("head_dim must be even (RoPE)")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's name and shape, in the order a Hugging Face checkpoint lists them."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (h, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, h)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "mlp.gate_proj.weight"] = (self.intermediate, h)
            shapes[p + "mlp.up_proj.weight"] = (self.intermediate, h)
            shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate)
        shapes["model.norm.weight"] = (h,)
        if not self.tied:
            shapes["lm_head.weight"] = (self.vocab, h)
        return shapes

    def params(self) -> int:
        return sum(math.prod(s) for s in self.tensor_shapes().values())

    def config(self) -> dict[str, Any]:
        """``config.json`` (SmolLM2's special token ids: the zoo uses its tokenizer)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": 1e-05,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_positions,
            "vocab_size": self.vocab,
            "tie_word_embeddings": self.tied,
            "attention_bias": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "initializer_range": INIT_STD,
            "torch_dtype": "bfloat16",
        }


def write_random_llama(dest: Path, shape: LlamaShape, seed: int, tokenizer_dir: Path) -> None:
    """Write the random model ``(shape, seed)`` at ``dest`` (atomically; kept if present)."""
    if dest.is_dir():
        return
    with _atomic_dir(dest) as tmp:
        (tmp / "config.json").write_text(json.dumps(shape.config(), indent=1, sort_keys=True))
        for name in _TOKENIZER_FILES:
            shutil.copyfile(tokenizer_dir / name, tmp / name)
        _write_streamed(tmp / "model.safetensors", shape, seed)


def perturbed_names(config: dict[str, Any], seed: int) -> tuple[str, ...]:
    """The tensors a fine-tune of seed ``seed`` changes: two layers' MLP and one attention proj."""
    layers = int(config["num_hidden_layers"])
    rng = np.random.default_rng(seed)
    mlp_layers = sorted(int(i) for i in rng.choice(layers, size=min(2, layers), replace=False))
    attn_layer, proj = int(rng.integers(layers)), _ATTENTION[int(rng.integers(len(_ATTENTION)))]
    names = [f"model.layers.{i}.mlp.{p}.weight" for i in mlp_layers for p in _MLP]
    return (*names, f"model.layers.{attn_layer}.self_attn.{proj}.weight")


def write_finetune(dest: Path, base_dir: Path, base_tensors: Path, seed: int) -> None:
    """Export the registered base (``base_dir``, its store file ``base_tensors``) to ``dest``
    with :func:`perturbed_names` changed (atomically; kept if present)."""
    import torch
    from safetensors.torch import load_file, save_file

    if dest.is_dir():
        return
    config = json.loads((base_dir / "config.json").read_text())
    weights = load_file(str(base_tensors))
    for name in perturbed_names(config, seed):
        w = weights[name]
        g = torch.Generator().manual_seed(_stream_seed(seed, name))
        noise = torch.randn(w.shape, generator=g, dtype=torch.float32)
        weights[name] = (w.float() + noise * (FINETUNE_STD * w.float().std())).to(w.dtype)
        if torch.equal(weights[name], w):  # would share the base's fingerprint: not a fine-tune
            raise RuntimeError(f"perturbing {name} left its bytes unchanged")
    with _atomic_dir(dest) as tmp:
        save_file(weights, str(tmp / "model.safetensors"))
        for name in ("config.json", *_TOKENIZER_FILES):
            shutil.copyfile(base_dir / name, tmp / name)


def write_tokenizer(dest: Path, gguf: Path) -> None:
    """SmolLM2's tokenizer files, as registration writes them for the GGUF (byte for byte)."""
    from runtime.gguf_import import read_gguf, write_hf_metadata

    if dest.is_dir():
        return
    model = read_gguf(gguf)
    try:
        with _atomic_dir(dest) as tmp:
            write_hf_metadata(model, tmp)
            (tmp / "config.json").unlink()  # SmolLM2's own; the zoo's models bring theirs
    finally:
        model.close()


def _stream_seed(seed: int, name: str) -> int:
    """One random stream per (seed, tensor): a tensor's values do not depend on the others."""
    return (seed << 32) ^ zlib.crc32(name.encode())


def _write_streamed(path: Path, shape: LlamaShape, seed: int) -> None:
    """A bfloat16 safetensors file written one tensor at a time (header first: shapes are known)."""
    import torch

    shapes = shape.tensor_shapes()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dims in shapes.items():
        nbytes = math.prod(dims) * 2
        header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as save_file does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, dims in shapes.items():
            if name.endswith("norm.weight"):
                values = torch.ones(dims, dtype=torch.bfloat16)
            else:
                rng = np.random.default_rng(_stream_seed(seed, name))
                drawn = rng.standard_normal(dims, dtype=np.float32) * np.float32(INIT_STD)
                values = torch.from_numpy(drawn).to(torch.bfloat16)
            f.write(values.view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def _atomic_dir(dest: Path) -> Iterator[Path]:
    """A temporary directory beside ``dest``, renamed to ``dest`` when the block succeeds:
    ``dest`` exists only complete. A leftover temporary of a crashed build is replaced."""
    tmp = dest.with_name(f"{_TMP_PREFIX}{dest.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        for file in tmp.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
