"""Llama-family decoder (Llama, SmolLM2, Qwen2) as plain functions over a weight table.

gpt-fast style, but with no ``nn.Module`` at all: building modules, even on the meta
device, costs ~80 ms for SmolLM2 (DESIGN.md, cold-start budget), while binding a dict of
pool tensor views costs microseconds and copies nothing. Covered: grouped-query attention,
RMSNorm, SwiGLU, RoPE (default and llama3 scaling), tied or untied embeddings, optional
q/k/v bias (Qwen2). Projection weights may be weight-only int8 / q4 (:class:`QuantWeight`,
layouts in :mod:`runtime.quant`), bound from the table with their scales.

KV cache: paged. ``kv_blocks`` is one tensor of shape (num_blocks, L, 2, BS, H_kv, D):
block b holds K and V of every layer for BS consecutive tokens of one sequence. It can be
a view over the pool arena (blocks at offsets ``b * block_bytes``) or any tensor of that
shape. A token's slot is ``block * BS + offset``; attention gathers a sequence's blocks
through its block table (the CPU counterpart of Tangram's E-Attention).
"""

from __future__ import annotations

import importlib.util
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the universal alias

from runtime.models.layer_gate import LayerGate
from runtime.models.lora import LoraAdapter, LoraBatch, plain
from runtime.models.quant_weight import QuantWeight, bind_weight
from runtime.quant import linear


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # llama3: factor, low/high_freq_factor, ...

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """From a Hugging Face ``config.json`` dict (llama, qwen2)."""
        heads = int(cfg["num_attention_heads"])
        # transformers < 5 writes rope_theta + rope_scaling; 5 writes one rope_parameters dict.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("llama3", "default"):
            raise ValueError(f"rope type {kind!r} is not supported")
        scaling = tuple(sorted(rope.items())) if kind == "llama3" else None
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope_scaling=scaling,
        )

    def kv_block_shape(self, block_size: int) -> tuple[int, int, int, int, int]:
        """Shape of one KV block: (L, 2, BS, H_kv, D)."""
        return (self.num_layers, 2, block_size, self.num_kv_heads, self.head_dim)

    def kv_block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        return math.prod(self.kv_block_shape(block_size)) * torch.empty((), dtype=dtype).element_size()


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,), float32, with llama3 scaling when configured."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    if config.rope_scaling is None:
        return inv
    s = dict(config.rope_scaling)
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


Linear = torch.Tensor | QuantWeight  # a projection: plain, or int8/q4 (runtime.quant layouts)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: tuple[Linear, Linear, Linear]
    qkv_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    o: Linear
    post_norm: torch.Tensor
    gate: Linear
    up: Linear
    down: Linear


@dataclass(frozen=True, slots=True)
class Batch:
    """One forward pass over the new tokens of several sequences, flattened.

    ``input_ids``/``positions``/``slots`` are (N,) for N new tokens in sequence order;
    ``query_lens[i]`` new tokens of sequence i, whose whole context is ``context_lens[i]``
    tokens (new ones included) held in blocks ``block_tables[i, :ceil(context/BS)]``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor  # (B, max_blocks) int64
    # Flat rows whose logits forward returns; None (the default, fast path): the last new
    # token of each sequence. Set only for requests asking for prompt log-probabilities.
    logit_rows: torch.Tensor | None = None
    # Which rows use which LoRA adapter (runtime.models.lora); None: no adapter in the batch.
    lora: LoraBatch | None = None


class LlamaModel:
    """Forward pass of a Llama-family model bound to a weight table (no copies)."""

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        use_cuda_kernels: bool | None = None,
        cpu_kernels: str | None = None,
        adapters: dict[str, LoraAdapter] | None = None,
        gate: LayerGate | None = None,
    ) -> None:
        """``gate``: the weights are still loading (a progressive pool acquire); the forward
        waits for each layer's tensors before it uses them. Nothing reads a weight's bytes
        before the forward does."""
        self.config = config
        # LoRA adapters a sequence may name (by key), applied unmerged per row (runtime.models.lora).
        self.adapters: dict[str, LoraAdapter] = dict(adapters or {})
        self.gate = gate
        self.weights = w = weights
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        # An int8 registration stores its LM head as int8 planes, a tied one as a copy
        # (runtime.store_weights.StoreWeights.quantize_head): the head is then that copy.
        tied = config.tie_word_embeddings and "lm_head.weight" not in w
        self.head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
        self.lm_head: Linear = bind_weight(w, self.head_name)
        self.layers = []

        def lin(name: str) -> Linear:  # a quantized weight binds with its scales
            return bind_weight(w, name)

        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = (
                (w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"])
                if config.attention_bias
                else None
            )
            self.layers.append(
                LayerWeights(
                    w[p + "input_layernorm.weight"],
                    (lin(a + "q_proj.weight"), lin(a + "k_proj.weight"), lin(a + "v_proj.weight")),
                    bias,
                    lin(a + "o_proj.weight"),
                    w[p + "post_attention_layernorm.weight"],
                    lin(p + "mlp.gate_proj.weight"),
                    lin(p + "mlp.up_proj.weight"),
                    lin(p + "mlp.down_proj.weight"),
                )
            )
        self.dtype = self.embed.dtype
        self.inv_freq = rope_inv_freq(config).to(self.embed.device)
        # On CUDA, KV writes and decode attention use the RawKernels of runtime.kernels_cuda
        # (prefill keeps SDPA) when CuPy is installed; False forces the torch path everywhere.
        if use_cuda_kernels is None:
            use_cuda_kernels = importlib.util.find_spec("cupy") is not None
        self.cuda_kernels = self.embed.is_cuda and use_cuda_kernels
        # On CPU, decode steps run through runtime._cpu_kernels (llama_decode) when it is built;
        # cpu_kernels (default $EMBER_CPU_KERNELS): auto, avx512, avx2, generic or off.
        from runtime.models.llama_decode import KernelPath

        self.cpu_kernels = KernelPath.create(self, cpu_kernels)

    @torch.inference_mode()
    def forward(self, batch: Batch, kv_blocks: torch.Tensor) -> torch.Tensor:
        """Logits (float32) of the last new token of each sequence: (B, vocab). When
        ``batch.logit_rows`` is set: the final hidden states of those rows, (R, hidden), for
        :meth:`lm_logits` (a long prompt's logits at once would take R x vocab floats)."""
        cfg = self.config
        device = self.embed.device
        host_ids = batch.input_ids  # rows read from the store file are gathered by host ids
        if batch.input_ids.device != device:  # batches are built on the host
            batch = Batch(
                batch.input_ids.to(device),
                batch.positions.to(device),
                batch.slots.to(device),
                batch.query_lens,
                batch.context_lens,
                batch.block_tables.to(device),
                None if batch.logit_rows is None else batch.logit_rows.to(device),
                None if batch.lora is None else batch.lora.to(device),
            )
        gate = self.gate
        if gate is not None and gate.done:  # everything is in: no check from now on
            self.gate = gate = None
        # The CPU kernels return last-token logits only: other rows take the torch path. They
        # know no LoRA either: a batch with any adapter row decodes on the torch path. They
        # wait per layer for a model still loading (runtime.models.llama_decode) as this does.
        if (
            self.cpu_kernels is not None
            and batch.logit_rows is None
            and batch.lora is None
            and self.cpu_kernels.wants(batch)
        ):
            return self.cpu_kernels.step(kv_blocks)(batch)
        proj = plain if batch.lora is None else batch.lora.project  # (layer, module, x, w, bias)
        # While the table loads, the prompt's rows come from the store file (runtime.models.embedding_rows).
        x = None if gate is None else gate.embed(host_ids)  # (N, E)
        if x is None:
            if gate is not None:
                gate.wait(0)
            x = F.embedding(batch.input_ids, self.embed)  # (N, E)
        else:
            x = x.to(self.embed.device)
        cos, sin = self._rope(batch.positions)  # (N, 1, D)
        block_size = kv_blocks.shape[3]
        block_idx, block_off = batch.slots // block_size, batch.slots % block_size
        for layer_id, lw in enumerate(self.layers):
            if gate is not None:
                gate.wait(layer_id + 1)
            h = _rms_norm(x, lw.input_norm, cfg.rms_norm_eps)
            q = proj(layer_id, "q_proj", h, lw.qkv[0], lw.qkv_bias[0] if lw.qkv_bias else None)
            k = proj(layer_id, "k_proj", h, lw.qkv[1], lw.qkv_bias[1] if lw.qkv_bias else None)
            v = proj(layer_id, "v_proj", h, lw.qkv[2], lw.qkv_bias[2] if lw.qkv_bias else None)
            q = _apply_rope(q.view(-1, cfg.num_heads, cfg.head_dim), cos, sin)  # (N, H, D)
            k = _apply_rope(k.view(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin)  # (N, Hkv, D)
            v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)  # (N, Hkv, D)
            k_cache, v_cache = kv_blocks[:, layer_id, 0], kv_blocks[:, layer_id, 1]  # (NB, BS, Hkv, D)
            if self.cuda_kernels:
                from runtime import kernels_cuda

                kernels_cuda.write_kv(
                    kv_blocks, layer_id, k.to(kv_blocks.dtype), v.to(kv_blocks.dtype), batch.slots
                )
            else:
                k_cache[block_idx, block_off] = k.to(k_cache.dtype)
                v_cache[block_idx, block_off] = v.to(v_cache.dtype)
            if self.cuda_kernels and all(n == 1 for n in batch.query_lens):
                from runtime import kernels_cuda

                # E-Attention: the kernel reads K/V by physical block number, no gather.
                attn = kernels_cuda.paged_decode_attention(
                    q, kv_blocks, layer_id, batch.block_tables, batch.context_lens
                ).reshape(-1, cfg.num_heads * cfg.head_dim)
            else:
                attn = self._attention(q, k, v, k_cache, v_cache, batch)  # (N, H*D)
            x = x + proj(layer_id, "o_proj", attn, lw.o)
            h = _rms_norm(x, lw.post_norm, cfg.rms_norm_eps)
            gated = F.silu(proj(layer_id, "gate_proj", h, lw.gate)) * proj(layer_id, "up_proj", h, lw.up)
            x = x + proj(layer_id, "down_proj", gated, lw.down)
        if batch.logit_rows is not None:
            last = batch.logit_rows
        else:
            last = torch.tensor(list(itertools.accumulate(batch.query_lens)), device=device) - 1
        if gate is not None:
            gate.wait(cfg.num_layers + 1)
        x = _rms_norm(x[last], self.norm, cfg.rms_norm_eps)
        if batch.logit_rows is not None:
            return x
        return self.lm_logits(x)

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (float32) of final hidden states (N, hidden): (N, vocab)."""
        return linear(hidden, self.lm_head).float()

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # (N, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (N, D)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: Batch,
    ) -> torch.Tensor:
        cfg = self.config
        if all(n == 1 for n in batch.query_lens) and len(batch.query_lens) > 1:
            return self._decode_attention(q, k_cache, v_cache, batch)
        out = []
        start = 0
        for i, (qlen, ctx) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
            qi = q[start : start + qlen].transpose(0, 1)  # (H, Tq, D)
            if qlen == ctx:  # whole context is new: attend to the fresh K/V, causally
                ki = k[start : start + qlen].transpose(0, 1)  # (Hkv, T, D)
                vi = v[start : start + qlen].transpose(0, 1)
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            else:  # new tokens at the end of a cached context: gather it from the blocks
                nb = -(-ctx // k_cache.shape[1])
                table = batch.block_tables[i, :nb]
                ki = k_cache[table].reshape(-1, cfg.num_kv_heads, cfg.head_dim)[:ctx].transpose(0, 1)
                vi = v_cache[table].reshape(-1, cfg.num_kv_heads, cfg.head_dim)[:ctx].transpose(0, 1)
                # query j (absolute position ctx - qlen + j) sees keys 0..ctx - qlen + j
                mask = torch.ones(qlen, ctx, dtype=torch.bool, device=q.device).tril(ctx - qlen)
                o = F.scaled_dot_product_attention(
                    qi, ki.to(qi.dtype), vi.to(qi.dtype), attn_mask=mask, enable_gqa=True
                )
            out.append(o.transpose(0, 1).reshape(qlen, cfg.num_heads * cfg.head_dim))  # (Tq, H*D)
            start += qlen
        return torch.cat(out) if len(out) > 1 else out[0]

    def _decode_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Batch
    ) -> torch.Tensor:
        """One new token per sequence: gather every sequence's blocks at once, mask the tail."""
        cfg = self.config
        bsz = len(batch.query_lens)
        ctx = torch.tensor(batch.context_lens, device=q.device)
        nb = -(-max(batch.context_lens) // k_cache.shape[1])
        table = batch.block_tables[:, :nb]
        k = k_cache[table].reshape(bsz, -1, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v_cache[table].reshape(bsz, -1, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        valid = torch.arange(k.shape[2], device=q.device)[None, :] < ctx[:, None]  # (B, T)
        mask = valid[:, None, None, :]  # (B, 1, 1, T)
        # Positions past a context hold whatever the arena held before (NaN/Inf bit patterns
        # included): a masked NaN still poisons SDPA, so zero them.
        k = k.masked_fill(~valid[:, None, :, None], 0)  # (B, Hkv, T, D)
        v = v.masked_fill(~valid[:, None, :, None], 0)
        o = F.scaled_dot_product_attention(
            q[:, None].transpose(1, 2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask, enable_gqa=True
        )  # (B, H, 1, D)
        return o.reshape(bsz, cfg.num_heads * cfg.head_dim)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 and scale in the model dtype, as transformers does (one fused op).
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
