"""CUDA kernels of the runtime (KV write, paged decode attention) and the model on CUDA.

Importing :mod:`runtime.kernels_cuda` and its argument checks are tested on CPU. Tests marked
``gpu`` run the kernels with real CuPy on a real device (against torch references, on a
strided KV view carved from a uint8 arena as the pool gives it) and the Llama forward on
CUDA against transformers; they skip cleanly where CuPy, a CUDA build of torch or a device is
missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the universal alias

from gpu_pool.errors import BackendUnavailable
from runtime import kernels_cuda
from runtime.engine.kv_storage import arena_kv_view, kv_block_bytes
from runtime.models.llama import Batch, LlamaConfig, LlamaModel

REPO_ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Output tolerance per dtype: the reference sees the same rounded inputs, so what differs is
# the float32 summation order and the final rounding to the dtype (2^-11 fp16, 2^-8 bf16).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def cache_config(num_layers: int, num_kv_heads: int, head_dim: int, group: int = 4) -> LlamaConfig:
    """A config that fixes the KV geometry (L, H_kv, D); the other fields do not matter here."""
    return LlamaConfig(
        vocab_size=32,
        hidden_size=num_kv_heads * group * head_dim,
        intermediate_size=32,
        num_layers=num_layers,
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        max_position_embeddings=256,
    )


def arena_cache(
    config: LlamaConfig,
    block_size: int,
    dtype: torch.dtype,
    num_blocks: int,
    device: torch.device,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(raw uint8 buffer, kv view, block_bytes): blocks 256 bytes apart beyond their size, at a
    256-byte offset into random bytes, so the view is strided and has gaps (like the arena's)."""
    block_bytes = kv_block_bytes(config, block_size, dtype) + 256
    raw = torch.randint(0, 256, (num_blocks * block_bytes + 512,), dtype=torch.uint8, generator=generator)
    raw = raw.to(device)
    kv = arena_kv_view(raw[256 : 256 + num_blocks * block_bytes], config, block_size, dtype, block_bytes)
    assert not kv.is_contiguous() and kv.stride(0) == block_bytes // kv.element_size()
    return raw, kv, block_bytes


# -- CPU: import and argument checks -----------------------------------------------------------


def test_imports_and_fails_cleanly_without_cupy() -> None:
    script = textwrap.dedent(
        """
        import sys

        class NoCupy:
            def find_spec(self, name, path=None, target=None):
                if name == "cupy" or name.startswith(("cupy.", "cupy_backends")):
                    raise ImportError("cupy is blocked in this test")
                return None

        sys.meta_path.insert(0, NoCupy())
        import runtime.kernels_cuda as k
        assert not any(m.startswith("cupy") for m in sys.modules), "cupy imported eagerly"
        assert callable(k.write_kv) and callable(k.paged_decode_attention)
        try:
            k.warm_up(0)
        except k.BackendUnavailable as exc:
            print("unavailable:", exc)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "unavailable:" in out.stdout and "CuPy" in out.stdout


def test_without_cupy_a_launch_raises_backend_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` now raises ImportError
    with pytest.raises(BackendUnavailable, match="CuPy"):
        kernels_cuda.warm_up(0)


def _cpu_case() -> dict[str, Any]:
    kv = torch.zeros(6, 2, 2, 4, 2, 8)  # (NB, L, 2, BS, H_kv, D)
    return {
        "kv": kv,
        "k": torch.zeros(3, 2, 8),
        "slots": torch.arange(3),
        "q": torch.zeros(2, 4, 8),
        "tables": torch.zeros(2, 3, dtype=torch.long),
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kv": torch.zeros(6, 2, 2, 4, 8)}, "kv_blocks must have shape"),
        ({"kv": torch.zeros(6, 2, 2, 4, 2, 8, dtype=torch.float64)}, "dtype"),
        ({"layer": 2}, "layer 2 is out of range"),
        ({"layer": "0"}, "layer must be an int"),
        ({"k": torch.zeros(3, 2, 4)}, r"k must have shape \(N, 2, 8\)"),
        ({"v": torch.zeros(2, 2, 8)}, "v must have the shape of k"),
        ({"k": torch.zeros(3, 2, 8, dtype=torch.float16)}, "must have the cache's dtype"),
        ({"slots": torch.arange(4)}, r"slots must have shape \(3,\)"),
        ({"slots": torch.zeros(3)}, "slots must be int32 or int64"),
        ({}, "kv_blocks must be a CUDA tensor"),
    ],
)
def test_write_kv_rejects_bad_arguments(change: dict[str, Any], message: str) -> None:
    case = _cpu_case()
    kv, k, slots = (
        change.get("kv", case["kv"]),
        change.get("k", case["k"]),
        change.get("slots", case["slots"]),
    )
    v = change.get("v", k)
    with pytest.raises(ValueError, match=message):
        kernels_cuda.write_kv(kv, change.get("layer", 1), k, v, slots)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": torch.zeros(2, 4, 8, 1)}, r"q must have shape \(B, H, D\)"),
        ({"q": torch.zeros(2, 4, 6)}, "q has head dim 6, but the cache has 8"),
        ({"q": torch.zeros(2, 3, 8)}, r"query heads \(3\) must be a positive multiple of kv heads \(2\)"),
        ({"q": torch.zeros(2, 4, 8, dtype=torch.float16)}, "must have the same dtype"),
        ({"kv": torch.zeros(6, 2, 2, 4, 2, 300), "q": torch.zeros(2, 4, 300)}, "head dim must be in"),
        ({"tables": torch.zeros(3, 3, dtype=torch.long)}, r"block_tables must have shape \(2, "),
        ({"tables": torch.zeros(2, 3)}, "block_tables must be int32 or int64"),
        ({"ctx": [1]}, "context_lens has 1 entries for 2 sequences"),
        ({"ctx": [1, 13]}, r"context_lens\[1\] = 13 is outside 0..12"),
        ({"ctx": torch.ones(3, dtype=torch.long)}, r"context_lens must have shape \(2,\)"),
        ({"ctx": torch.ones(2)}, "context_lens must be int32 or int64"),
        ({"scale": float("nan")}, "scale must be finite"),
        ({}, "must be a CUDA tensor"),
    ],
)
def test_paged_decode_attention_rejects_bad_arguments(change: dict[str, Any], message: str) -> None:
    case = _cpu_case()
    with pytest.raises(ValueError, match=message):
        kernels_cuda.paged_decode_attention(
            change.get("q", case["q"]),
            change.get("kv", case["kv"]),
            0,
            change.get("tables", case["tables"]),
            change.get("ctx", [1, 12]),
            change.get("scale"),
        )


# -- GPU: the kernels against torch ------------------------------------------------------------


@pytest.fixture
def cuda() -> torch.device:
    """The CUDA device the kernel tests run on; skips without CuPy, CUDA torch or a device."""
    with warnings.catch_warnings():  # a CuPy install may warn at import (e.g. about CUDA_PATH)
        warnings.simplefilter("ignore")
        pytest.importorskip("cupy", exc_type=ImportError)
    if not torch.cuda.is_available():
        pytest.skip("torch has no usable CUDA device (CPU build, or no device visible)")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_write_kv_matches_torch_indexing(cuda: torch.device, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    config = cache_config(num_layers=3, num_kv_heads=2, head_dim=40)
    block_size, num_blocks, layer, n = 4, 11, 1, 13
    raw, kv, block_bytes = arena_cache(config, block_size, dtype, num_blocks, cuda, g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[5] = -1  # padding: skipped
    # k is a non-contiguous view, v a plain tensor; slots int32
    k = torch.randn(2, n, 40, generator=g).to(dtype).transpose(0, 1)  # (N, H_kv, D)
    v = torch.randn(n, 2, 40, generator=g).to(dtype)  # (N, H_kv, D)

    expected_raw = raw.clone()
    expected = arena_kv_view(
        expected_raw[256 : 256 + num_blocks * block_bytes], config, block_size, dtype, block_bytes
    )
    keep = slots >= 0
    s = slots[keep].to(cuda)
    expected[:, layer, 0][s // block_size, s % block_size] = k[keep].to(cuda)  # as LlamaModel does
    expected[:, layer, 1][s // block_size, s % block_size] = v[keep].to(cuda)

    kernels_cuda.write_kv(kv, layer, k.to(cuda), v.to(cuda), slots.to(torch.int32).to(cuda))
    torch.cuda.synchronize(cuda)
    # Byte for byte: the written slots, every other slot and layer, and the gaps between blocks.
    assert torch.equal(raw, expected_raw)
    # Nothing to write is fine.
    kernels_cuda.write_kv(kv, 0, k[:0].to(cuda), v[:0].to(cuda), slots[:0].to(cuda))


@pytest.mark.gpu
def test_gpu_kernels_run_on_torchs_current_stream(cuda: torch.device) -> None:
    g = torch.Generator().manual_seed(2)
    config = cache_config(num_layers=1, num_kv_heads=8, head_dim=128)
    block_size, num_blocks, n = 16, 512, 4096
    kv = torch.zeros(num_blocks, *config.kv_block_shape(block_size), device=cuda)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n].to(cuda)
    side = torch.cuda.Stream(cuda)
    side.wait_stream(torch.cuda.current_stream(cuda))
    with torch.cuda.stream(side):
        # produced on the side stream and consumed right away: correct only if the kernel is
        # ordered after the producers, i.e. launched on the side stream too
        k = torch.randn(n, 8, 128, device=cuda).mul_(3.0)
        v = k.neg()
        kernels_cuda.write_kv(kv, 0, k, v, slots)
        q = torch.randn(2, 8, 128, device=cuda)
        tables = (slots[: 2 * 32].view(2, 32) // block_size).contiguous()
        out = kernels_cuda.paged_decode_attention(q, kv, 0, tables, [1, 1])
    side.synchronize()
    torch.testing.assert_close(kv[slots // block_size, 0, 0, slots % block_size], k, atol=0, rtol=0)
    torch.testing.assert_close(kv[slots // block_size, 0, 1, slots % block_size], v, atol=0, rtol=0)
    # context 1: the output is V of the first token of the first block (token offset 0)
    first = kv[tables[:, 0], 0, 1, 0]  # (2, H_kv, D)
    torch.testing.assert_close(out, first, atol=1e-6, rtol=1e-6)


def reference_decode(
    q: torch.Tensor, kv: torch.Tensor, layer: int, tables: torch.Tensor, lens: list[int], scale: float
) -> torch.Tensor:
    """Gather every sequence's blocks, mask by context length, SDPA with GQA, in float64 on CPU."""
    bsz, _, head_dim = q.shape
    block_size, num_kv_heads = kv.shape[3], kv.shape[4]
    width = tables.shape[1] * block_size
    safe = tables.clamp(min=0).cpu()  # unused entries are -1; masked anyway
    k = kv[:, layer, 0].cpu().double()[safe].reshape(bsz, width, num_kv_heads, head_dim).transpose(1, 2)
    v = kv[:, layer, 1].cpu().double()[safe].reshape(bsz, width, num_kv_heads, head_dim).transpose(1, 2)
    mask = (torch.arange(width)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]  # (B, 1, 1, T)
    out = F.scaled_dot_product_attention(
        q.cpu().double()[:, :, None], k, v, attn_mask=mask, scale=scale, enable_gqa=True
    )  # (B, H, 1, D)
    return out[:, :, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 80, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_paged_decode_attention_matches_sdpa(
    cuda: torch.device, dtype: torch.dtype, head_dim: int
) -> None:
    g = torch.Generator().manual_seed(3)
    num_kv_heads, group, block_size, num_blocks, layer = 2, 4, 16, 64, 1
    config = cache_config(num_layers=2, num_kv_heads=num_kv_heads, head_dim=head_dim, group=group)
    _, kv, _ = arena_cache(config, block_size, dtype, num_blocks, cuda, g)
    kv.copy_(torch.randn(kv.shape, generator=g).to(dtype).to(cuda))
    # lengths: 1, exact multiples of BS, one short of and past a block boundary, long
    lens = [1, block_size, 2 * block_size, 3 * block_size + 5, 37, block_size - 1, 100, 4 * block_size]
    width = max(-(-n // block_size) for n in lens) + 1
    tables = torch.full((len(lens), width), -1, dtype=torch.long)  # unused entries must not be read
    free = torch.randperm(num_blocks, generator=g).tolist()  # scattered physical blocks
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[i, :nb] = torch.tensor([free.pop() for _ in range(nb)])
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=g).to(dtype)  # (B, H, D)
    scale = head_dim**-0.5
    expected = reference_decode(q, kv, layer, tables, lens, scale)

    out = kernels_cuda.paged_decode_attention(q.to(cuda), kv, layer, tables.to(cuda), lens)
    assert out.shape == q.shape and out.dtype == dtype and out.device == cuda
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)

    # The same with device tensors of other int types and an explicit scale.
    out = kernels_cuda.paged_decode_attention(
        q.to(cuda),
        kv,
        layer,
        tables.to(torch.int32).to(cuda),
        torch.tensor(lens, dtype=torch.int32).to(cuda),
        0.5,
    )
    expected = reference_decode(q, kv, layer, tables, lens, 0.5)
    torch.testing.assert_close(out.cpu().double(), expected, atol=tol, rtol=tol)


@pytest.mark.gpu
def test_gpu_paged_decode_attention_guards(cuda: torch.device) -> None:
    kernels_cuda.warm_up(cuda)  # compiles (or loads) every kernel up front
    g = torch.Generator().manual_seed(4)
    config = cache_config(num_layers=1, num_kv_heads=1, head_dim=64)
    kv = torch.randn(8, *config.kv_block_shape(4), generator=g).to(cuda)
    tables = torch.tensor([[0, 1], [2, 9], [3, 4], [5, -1]], device=cuda)
    lens = torch.tensor([8, 6, 0, 50], device=cuda)  # 9 is no block; 50 is clamped to 2 * 4 = 8
    q = torch.randn(4, 4, 64, generator=g).to(cuda)
    out = kernels_cuda.paged_decode_attention(q, kv, 0, tables, lens)
    torch.cuda.synchronize(cuda)
    assert torch.isfinite(out[0]).all()
    assert torch.isnan(out[1]).all()  # a block number outside the cache poisons the output
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # empty context
    assert torch.isnan(out[3]).all()  # clamped to 8 tokens, whose second block is -1


# -- GPU: the model on CUDA --------------------------------------------------------------------

BLOCK = 4


def tiny_llama(device: torch.device) -> tuple[Any, dict[str, Any]]:
    """A random tiny transformers Llama with grouped-query attention, on ``device``, float32."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.eval().to(device)
    return model, {**cfg.to_dict(), "model_type": "llama"}


def make_batch(seqs: list[tuple[list[int], int, list[int]]], device: torch.device) -> Batch:
    """The CPU test's batch, moved to ``device``."""
    from tests.runtime.test_llama import make_batch as host_batch

    b = host_batch(seqs)
    return Batch(
        b.input_ids.to(device), b.positions.to(device), b.slots.to(device), b.query_lens, b.context_lens,
        b.block_tables.to(device),
    )  # fmt: skip


@pytest.mark.gpu
def test_gpu_llama_greedy_matches_transformers(torch_cuda: torch.device) -> None:
    device = torch_cuda
    ref, cfg = tiny_llama(device)
    config = LlamaConfig.from_hf(cfg)
    model = LlamaModel(config, dict(ref.state_dict()))  # CUDA weights, bound without copies
    assert model.embed.device == device
    block_bytes = kv_block_bytes(config, BLOCK, torch.float32)
    arena = torch.zeros(32 * block_bytes, dtype=torch.uint8, device=device)  # as attach_cuda gives
    kv = arena_kv_view(arena, config, BLOCK, torch.float32, block_bytes)

    def reference(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return ref(torch.tensor([tokens], device=device)).logits[0, -1].float()

    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, 97, (11,), generator=g).tolist()
    b = torch.randint(0, 97, (6,), generator=g).tolist()
    blocks_a, blocks_b = [7, 2, 9, 30, 11, 25], [5, 1, 20, 14]  # scattered physical blocks
    logits = model.forward(make_batch([(a, 0, blocks_a), (b, 0, blocks_b)], device), kv)  # prefill
    generated: tuple[list[int], list[int]] = ([], [])
    for step in range(7):  # greedy decode, both sequences in one batch, crossing block boundaries
        for i, seq in enumerate((a, b)):
            expected = reference(seq)
            torch.testing.assert_close(logits[i], expected, atol=1e-3, rtol=1e-3, msg=f"step {step}")
            token = int(logits[i].argmax())
            assert token == int(expected.argmax()), f"sequence {i}, step {step}"
            generated[i].append(token)
        batch = make_batch(
            [([generated[0][-1]], len(a), blocks_a), ([generated[1][-1]], len(b), blocks_b)], device
        )
        a.append(generated[0][-1])
        b.append(generated[1][-1])
        logits = model.forward(batch, kv)
    for i, seq in enumerate((a, b)):
        torch.testing.assert_close(logits[i], reference(seq), atol=1e-3, rtol=1e-3)
    # a chunk of new tokens after a cached context (recompute / chunked prefill)
    chunk = [3, 1, 4]
    logits = model.forward(make_batch([(chunk, len(a), blocks_a)], device), kv)
    torch.testing.assert_close(logits[0], reference(a + chunk), atol=1e-3, rtol=1e-3)
