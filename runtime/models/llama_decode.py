"""A Llama-family forward pass through the CPU kernels (``runtime._cpu_kernels``).

Eager PyTorch spends more time dispatching a decode step's ~35 ops per layer than reading the
weights; here every layer is nine kernels in C, all layers of a step one call
(``decoder_layers``: no Python between a step's 270 kernels, 1-2 % on SmolLM2 bf16 decode),
with addresses prepared once per model and KV tensor, activations fp32 in scratch buffers that
live as long as this object:

    x    (N, E)            residual stream (rounded to the model dtype, as the torch path does)
    h    (N, E)            normed input of attention / MLP
    qkv  (N, (H+2Hkv)*D)   q | k | v side by side; RoPE in place on q | k
    attn (N, H*D)          attention output, K/V read in place from the paged blocks
    mlp  (N, I)            silu(gate) * up

Any batch runs here (a prefill token attends to its own context prefix, so one token is one
row whatever its sequence): :class:`~runtime.models.llama.LlamaModel` decides which steps do.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from runtime.cpu_kernels import ops
from runtime.cpu_kernels.ops import KVLayout, Weight

if TYPE_CHECKING:
    from runtime.models.llama import Batch, LlamaModel

ROPE_CHUNK = 4096  # positions per growth of the cos/sin table
# Prefills of at most this many new tokens run through the kernels too: measured on SmolLM2
# bf16 (one thread), the kernels took 28/36/68 ms for 2/4/8 tokens against torch's 46/73/79,
# and lost from 16 tokens on (133 vs 93 ms: oneDNN's bf16 GEMM beats fp32 FMAs once compute-bound).
PREFILL_TOKENS = 8
# On the AVX2 path a bf16 model's prefills all run through the kernels: that CPU has no bf16
# instructions for oneDNN's GEMM, and on a Zen 3 VM (SmolLM2 bf16, 2 threads, new prompts) the
# kernels took 36/134/530/2,507 ms for 8/32/128/512 tokens against torch's 109/408/1,672/6,837.
AVX2_BF16_PREFILL_TOKENS = 1 << 62


class KernelWeights:
    """Descriptors of a model's weights (int64 tables the kernels read), built once per model."""

    def __init__(self, model: LlamaModel, q8_codes: bool = True) -> None:
        cfg, w = model.config, model.weights
        self.round = int(model.dtype == torch.bfloat16)
        # A bf16 model's linear inputs are bf16 values: bf16 weights may use bf16 dot products.
        self.flags = ops.ROUND_BF16 | ops.X_BF16 if self.round else 0
        if q8_codes:  # see KernelPath.q8_codes
            self.flags |= ops.X_Q8
        self.norm_code = ops.float_code(model.dtype)
        self.embed = ops.descriptors([Weight.from_table(w, "model.embed_tokens.weight")])
        self.head = ops.descriptors([Weight.from_table(w, model.head_name)])
        self.norm = model.norm.data_ptr()
        self.layers: list[tuple[int, torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor]] = []
        for i in range(cfg.num_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            qkv = [
                Weight.from_table(
                    w, f"{a}{n}_proj.weight", f"{a}{n}_proj.bias" if cfg.attention_bias else None
                )
                for n in "qkv"
            ]
            mlp = [Weight.from_table(w, f"{p}mlp.{n}_proj.weight") for n in ("gate", "up")]
            self.layers.append(
                (
                    w[p + "input_layernorm.weight"].data_ptr(),
                    ops.descriptors(qkv),
                    ops.descriptors([Weight.from_table(w, a + "o_proj.weight")]),
                    w[p + "post_attention_layernorm.weight"].data_ptr(),
                    ops.descriptors(mlp),
                    ops.descriptors([Weight.from_table(w, p + "mlp.down_proj.weight")]),
                )
            )
        self.cos, self.sin = ops.rope_table(model.inv_freq.cpu(), ROPE_CHUNK)

    def rope_for(self, inv_freq: torch.Tensor, max_position: int) -> None:
        """Grow the cos/sin table to cover ``max_position`` (rare: once per ROPE_CHUNK)."""
        if max_position >= self.cos.shape[0]:
            size = -(-(max_position + 1) // ROPE_CHUNK) * ROPE_CHUNK
            self.cos, self.sin = ops.rope_table(inv_freq.cpu(), size)


class KernelStep:
    """One model's forward pass over one KV tensor, through the kernels."""

    def __init__(self, ext: ModuleType, model: LlamaModel, weights: KernelWeights, kv_blocks: torch.Tensor):
        cfg = model.config
        self.ext, self.model, self.w = ext, model, weights
        self.kv = [KVLayout.of(kv_blocks, i) for i in range(cfg.num_layers)]
        # The layers as decoder_layers reads them, (L, 7): norm, q|k|v, o, norm, gate|up, down, KV.
        self.layers = torch.tensor(
            [
                [norm, qkv.data_ptr(), o.data_ptr(), norm2, mlp.data_ptr(), down.data_ptr(), kv.address]
                for (norm, qkv, o, norm2, mlp, down), kv in zip(weights.layers, self.kv, strict=True)
            ],
            dtype=torch.int64,
        )
        self.capacity = 0
        # Zeroed: their pages fault in here, where an engine is built (a standby's while it
        # waits), not in an activated standby's first forward pass (~66 pages of SmolLM2's).
        self._grow(16, torch.zeros)

    def _grow(self, tokens: int, alloc: Callable[..., torch.Tensor] = torch.empty) -> None:
        cfg = self.model.config
        n = max(tokens, 2 * self.capacity)
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.x = alloc(n, cfg.hidden_size)
        self.h = alloc(n, cfg.hidden_size)
        self.qkv = alloc(n, qkv)
        self.attn = alloc(n, cfg.num_heads * cfg.head_dim)
        self.mlp = alloc(n, cfg.intermediate_size)
        self.arange = torch.arange(n)
        self.capacity = n

    @torch.inference_mode()
    def __call__(self, batch: Batch) -> torch.Tensor:
        """Logits (float32) of the last new token of each sequence: (B, vocab)."""
        cfg, k, w = self.model.config, self.ext, self.w
        n, bsz = int(batch.input_ids.shape[0]), len(batch.query_lens)
        if n > self.capacity:
            self._grow(n)
        ids, positions, slots = batch.input_ids, batch.positions, batch.slots
        tables = batch.block_tables.contiguous()
        if n == bsz:  # decode: one row per sequence
            rows, ctx = self.arange, torch.tensor(batch.context_lens)
            last = 0
        else:  # row j of sequence i sees its context up to itself
            rows = torch.tensor([i for i, q in enumerate(batch.query_lens) for _ in range(q)])
            ctx = positions + 1
            last_rows = torch.tensor(list(itertools.accumulate(batch.query_lens))) - 1
            last = last_rows.data_ptr()
        w.rope_for(self.model.inv_freq, int(positions.max()))
        threads = torch.get_num_threads()
        e, d, h, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        inter, eps, rnd = cfg.intermediate_size, cfg.rms_norm_eps, w.round
        x, hb = self.x.data_ptr(), self.h.data_ptr()
        kv = self.kv[0]  # dtype, block stride and size: one KV tensor, the same for every layer
        step = (
            n, e, h, hkv, d, inter, x, hb, self.qkv.data_ptr(), self.attn.data_ptr(), self.mlp.data_ptr(),
            positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1], rows.data_ptr(),
            ctx.data_ptr(), w.cos.data_ptr(), w.sin.data_ptr(), w.norm_code, kv.dtype, kv.block_stride,
            kv.block_size, eps, d**-0.5, w.flags, rnd,
        )  # fmt: skip
        gate = self.model.gate  # weights still loading (runtime.models.layer_gate): wait per layer
        prompt_rows = None if gate is None else gate.embed(ids)  # (N, E) from the store file while it loads
        if prompt_rows is None:
            if gate is not None:
                gate.wait(0)
            k.embedding(w.embed.data_ptr(), ids.data_ptr(), n, e, x, e)
        else:
            self.x[:n].copy_(prompt_rows)  # float32 rows, as the kernel writes them
        layers, row_bytes = self.layers.data_ptr(), self.layers.stride(0) * 8
        if gate is None:  # every layer in one call: no Python between a step's ~270 kernels
            k.decoder_layers(threads, layers, cfg.num_layers, *step)
        else:
            for i in range(cfg.num_layers):
                gate.wait(i + 1)
                k.decoder_layers(threads, layers + i * row_bytes, 1, *step)
        if gate is not None:
            gate.wait(cfg.num_layers + 1)
        k.rms_norm(x, e, last, hb, e, w.norm, w.norm_code, bsz, e, eps, rnd)
        logits = torch.empty(bsz, cfg.vocab_size)
        k.linear(threads, w.head.data_ptr(), 1, hb, e, bsz, e, logits.data_ptr(), cfg.vocab_size, w.flags, 0)
        return logits


class KernelPath:
    """Which steps of one model run through the kernels, and their prepared state.

    Decode steps (every sequence has one new token) always do; so does every step of a model
    with quantized weights (the torch path cannot read them); prefills of float models keep
    torch (oneDNN) above ``prefill_tokens`` new tokens (default: :data:`PREFILL_TOKENS`, or
    every prefill of a bf16 model on the AVX2 path, :data:`AVX2_BF16_PREFILL_TOKENS`).

    ``q8_codes`` (set before the first step): int8 (q8_0) weights meet the activations
    quantized to int8 per group of 32 where the path has integer dot products (AVX2), as
    llama.cpp's Q8_0 does: on one Zen 3 core a (46,080 x 576) int8 matrix times one token took
    2.0 ms against 2.6 ms widening every weight to fp32, and SmolLM2 int8's perplexity on
    Alice ch. I went from 20.113 to 20.134 (bf16: 20.085). False: fp32 activations, the
    dequantized model's results up to summation order."""

    def __init__(self, ext: ModuleType, model: LlamaModel, prefill_tokens: int | None = None) -> None:
        self.ext, self.model = ext, model
        self.isa = ext.isa()  # the extension's choice is process-wide: each step re-applies ours
        if prefill_tokens is None:
            avx2_bf16 = self.isa == "avx2" and model.dtype == torch.bfloat16
            prefill_tokens = AVX2_BF16_PREFILL_TOKENS if avx2_bf16 else PREFILL_TOKENS
        self.prefill_tokens = prefill_tokens
        self.quantized = any(t.dtype in (torch.int8, torch.uint8) for t in model.weights.values())
        self.q8_codes = True
        self._weights: KernelWeights | None = None
        # Per KV tensor, held weakly: an engine's arena view must not outlive the engine here.
        self._steps: dict[int, tuple[weakref.ref[torch.Tensor], KernelStep]] = {}

    @classmethod
    def create(cls, model: LlamaModel, choice: str | None) -> KernelPath | None:
        """The kernel path of ``model``, or None where the torch path runs every step."""
        if model.embed.device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16):
            return None
        ext = ops.load(choice)
        return cls(ext, model) if ext is not None else None

    def wants(self, batch: Batch) -> bool:
        n = int(batch.input_ids.shape[0])
        return self.quantized or n == len(batch.query_lens) or n <= self.prefill_tokens

    def prepare(self, kv_blocks: torch.Tensor) -> KernelStep:
        """The step over ``kv_blocks``, built on first use (weight descriptors, scratch, RoPE
        table): an engine builds it with itself, so no request pays for it."""
        entry = self._steps.get(id(kv_blocks))
        if entry is None or entry[0]() is not kv_blocks:
            self._steps = {k: v for k, v in self._steps.items() if v[0]() is not None}
            if self._weights is None:
                self._weights = KernelWeights(self.model, self.q8_codes)
            entry = (weakref.ref(kv_blocks), KernelStep(self.ext, self.model, self._weights, kv_blocks))
            self._steps[id(kv_blocks)] = entry
        return entry[1]

    def step(self, kv_blocks: torch.Tensor) -> KernelStep:
        step = self.prepare(kv_blocks)
        self.ext.set_isa(self.isa)
        return step
