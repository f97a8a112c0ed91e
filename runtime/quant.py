"""Weight-only quantization of the decoder's linear weights: the store layouts and their reference.

Two methods, groups of :data:`GROUP` = 32 consecutive ``in`` values of an (out, in) weight
(llama.cpp's Q8_0 and Q4_1 blocks, laid out as separate planes so kernels and the pool see plain
tensors; the CPU kernels read exactly these, so do not change them):

* ``int8``: ``<name>`` int8 (out, in) and ``<name>.scales`` float16 (out, in/32);
  w = q * s, s = max|w| / 127 of the group, q = round(w / s).
* ``q4``: ``<name>`` uint8 (out, in/2), two 4-bit codes per byte, the low nibble the even
  index; ``<name>.scales`` and ``<name>.mins`` float16 (out, in/32); w = q * s + m,
  q in 0..15, m = min of the group, s = (max - min) / 15.

Codes are computed as llama.cpp computes them (float32 scale, ``roundf``-style rounding), so a
weight quantized here gets the codes ``llama-quantize`` would give it; GGUF blocks that are
already Q8_0 / Q4_1 are carried over as they are (:func:`from_ggml`, exact, no round trip).
Only the q/k/v/o/gate/up/down projections of the decoder layers are quantized
(:func:`quantizable`); embeddings, the LM head, norms and biases stay bfloat16.

:func:`dequantize` and :func:`linear` are the torch reference: the engine's fallback when the
CPU kernels are absent (dequantize on the fly, per forward, from the pool's bytes: nothing
private stays resident) and what the kernels are tested against.
"""

from __future__ import annotations

import re

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - the universal alias

from runtime.models.quant_weight import MINS, SCALES, QuantWeight

GROUP = 32
METHODS = ("int8", "q4")
# The GGML block type (gguf.GGMLQuantizationType) each method carries over unchanged.
GGML_Q4_1, GGML_Q8_0 = 3, 8
GGML_SOURCE = {"int8": GGML_Q8_0, "q4": GGML_Q4_1}
_GGML_BLOCK_BYTES = {GGML_Q8_0: 2 + GROUP, GGML_Q4_1: 4 + GROUP // 2}
_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


def is_linear_weight(name: str) -> bool:
    """A decoder layer's projection weight (Hugging Face name): the tensors quantization covers."""
    return _LINEAR.fullmatch(name) is not None


def quantizable(name: str, shape: tuple[int, ...]) -> str | None:
    """Why ``name`` stays unquantized (None: it can be quantized)."""
    if not is_linear_weight(name):
        return "not a decoder projection weight"
    if len(shape) != 2:
        return f"shape {shape} is not 2-D"
    if shape[1] % GROUP:
        return f"in_features {shape[1]} is not a multiple of {GROUP}"
    return None


def quantize(weight: torch.Tensor, method: str) -> dict[str, torch.Tensor]:
    """The store tensors of a float (out, in) weight: suffix (``""``, ``.scales``, ``.mins``) -> tensor."""
    out, cols = weight.shape
    g = weight.detach().float().reshape(out, cols // GROUP, GROUP)
    if method == "int8":
        d = g.abs().amax(-1) / 127  # (out, G)
        q = _round_away(g * _inverse(d)[..., None]).clamp(-127, 127).to(torch.int8)
        return {"": q.reshape(out, cols), SCALES: d.to(torch.float16)}
    if method == "q4":
        lo, hi = g.amin(-1), g.amax(-1)
        d = (hi - lo) / 15
        codes = torch.floor((g - lo[..., None]) * _inverse(d)[..., None] + 0.5).clamp(0, 15).to(torch.uint8)
        return {
            "": pack_nibbles(codes.reshape(out, cols)),
            SCALES: d.to(torch.float16),
            MINS: lo.to(torch.float16),
        }
    raise ValueError(f"unknown quantization method {method!r} (choose from {', '.join(METHODS)})")


def from_ggml(rows: np.ndarray, qtype: int, method: str) -> dict[str, torch.Tensor]:
    """Carry GGML blocks over into the store layout, bit for bit (no dequantize/requantize).

    ``rows``: uint8 (out, bytes per row) of Q8_0 blocks (fp16 d, 32 int8) for ``int8`` or Q4_1
    blocks (fp16 d, fp16 m, 16 bytes: element j in the low nibble of byte j, element j+16 in
    its high nibble) for ``q4``.
    """
    if GGML_SOURCE.get(method) != qtype:
        raise ValueError(f"GGML type {qtype} cannot be carried over as {method!r}")
    out = rows.shape[0]
    blocks = np.ascontiguousarray(rows).reshape(out, -1, _GGML_BLOCK_BYTES[qtype])  # (out, G, block)
    groups = blocks.shape[1]
    d = torch.from_numpy(np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).reshape(out, groups))
    if qtype == GGML_Q8_0:
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(out, groups * GROUP)
        return {"": torch.from_numpy(q), SCALES: d}
    m = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).reshape(out, groups))
    qs = blocks[..., 4:]  # (out, G, 16)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(out, groups * GROUP)
    return {"": pack_nibbles(torch.from_numpy(codes)), SCALES: d, MINS: m}


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 (out, in) -> (out, in/2), the even index in the low nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: (out, in/2) -> uint8 codes (out, in)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def dequantize(w: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The (out, in) weight in ``dtype``: computed in float32 (exact products), then rounded."""
    out, cols = w.out_features, w.in_features
    codes = w.q if w.method == "int8" else unpack_nibbles(w.q)
    g = codes.reshape(out, cols // GROUP, GROUP).to(torch.float32)
    g.mul_(w.scales.to(torch.float32)[..., None])  # in place: one float32 temporary, not three
    if w.mins is not None:
        g.add_(w.mins.to(torch.float32)[..., None])
    return g.reshape(out, cols).to(dtype)


def linear(x: torch.Tensor, w: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for plain and quantized weights; a quantized one is dequantized for this call
    into ``x``'s dtype (the torch fallback: transient, freed after the matmul)."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    return F.linear(x, dequantize(w, x.dtype), bias)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, 0 where d is 0 (an all-equal group: every code 0, w = m)."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: halves away from zero (torch.round rounds them to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)
