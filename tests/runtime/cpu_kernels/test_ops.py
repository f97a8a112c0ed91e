"""Every CPU kernel against a torch reference, on both ISA paths (runtime.cpu_kernels.ops)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from runtime.cpu_kernels import ops
from runtime.cpu_kernels.ops import CpuKernelError, KVLayout, Weight

_EXT = ops.load("auto")
AVAILABLE = ops.available_isas()
pytestmark = pytest.mark.skipif(_EXT is None, reason="runtime._cpu_kernels is not built")
ISAS = ["generic", "avx2", "avx512"]


@pytest.fixture(params=ISAS)
def ext(request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    if request.param not in AVAILABLE:
        pytest.skip(f"this CPU lacks the {request.param} path")
    mod = ops.load(request.param)
    assert mod is not None and mod.isa() == request.param
    try:
        yield mod
    finally:
        ops.load("auto")


def quantize_q8_0(w: torch.Tensor) -> Weight:
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    scales = (g.abs().amax(-1) / 127).clamp_min(1e-8).half()
    q = torch.round(g / scales.float()[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
    return Weight(q, scales)


def quantize_q4_1(w: torch.Tensor) -> Weight:
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = ((hi - lo) / 15).clamp_min(1e-8).half()
    mins = lo.half()
    q = torch.round((g - mins.float()[..., None]) / scales.float()[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.reshape(n, k // 2, 2)
    return Weight((q[..., 0] | (q[..., 1] << 4)).contiguous(), scales, mins)


def make_weight(kind: str, n: int, k: int, g: torch.Generator) -> Weight:
    w = torch.randn(n, k, generator=g)
    if kind == "f32":
        return Weight(w)
    if kind == "bf16":
        return Weight(w.bfloat16())
    return quantize_q8_0(w) if kind == "q8_0" else quantize_q4_1(w)


KINDS = ["f32", "bf16", "q8_0", "q4_1"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 4, 7, 64])
def test_linear_matches_dequantized_reference(ext: ModuleType, kind: str, m: int) -> None:
    g = torch.Generator().manual_seed(m)
    k = 96 if kind in ("q8_0", "q4_1") else 83  # float layouts: a K that is no multiple of 16
    w = make_weight(kind, 37, k, g)  # out_features no multiple of 4 or 16
    x = torch.randn(m, k, generator=g)
    got = ops.linear(ext, x, [w], threads=2)
    ref = x.double() @ w.dequantize().double().T
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)


def q8_codes(x: torch.Tensor) -> torch.Tensor:
    """x as the CK_X_Q8 codes give it back (fp32 ops as the C code does them): per group of 32,
    d = max|x| / 127, q = round(x * 127 / max|x|) to nearest even; returns q * d."""
    m, k = x.shape
    groups = x.reshape(m, k // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(groups * inv).double() * (amax / 127.0).double()).reshape(m, k)


@pytest.mark.parametrize("m", [1, 4, 7, 64])
@pytest.mark.parametrize("k", [96, 576])  # an odd number of groups (a tail), and SmolLM2's width
def test_q8_codes_of_x_give_exact_integer_products(ext: ModuleType, m: int, k: int) -> None:
    """x_q8 on a path with integer dots: the products of the weights and x's codes, exactly
    summed per group (up to fp32 summation of the groups); elsewhere the flag changes nothing."""
    g = torch.Generator().manual_seed(m + k)
    w = make_weight("q8_0", 37, k, g)
    x = torch.randn(m, k, generator=g) * 3
    got = ops.linear(ext, x, [w], x_q8=True, threads=2)
    plain = ops.linear(ext, x, [w], threads=2)
    if not ext.q8_dot():
        assert torch.equal(got, plain)
        return
    ref = q8_codes(x) @ w.dequantize().double().T
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
    assert not torch.equal(got, plain)  # it did take the codes
    swi = ops.linear(ext, x, [w, w], x_q8=True, swiglu=True, threads=2)  # the fused epilogue too
    torch.testing.assert_close(swi, F.silu(got) * got, rtol=1e-5, atol=1e-5)


def test_q8_codes_of_strided_and_tiny_x(ext: ModuleType) -> None:
    """x as a view of a wider tensor (row stride > k: the codes are packed, x is not), and a group
    too small for 127 / max|x| to be finite (its codes and scale are 0: it adds nothing)."""
    g = torch.Generator().manual_seed(7)
    w = make_weight("q8_0", 20, 64, g)
    wide = torch.randn(3, 96, generator=g)
    x = wide[:, :64]
    assert x.stride(0) == 96
    got = ops.linear(ext, x, [w], x_q8=True, threads=2)
    assert torch.equal(got, ops.linear(ext, x.contiguous(), [w], x_q8=True, threads=2))
    tiny = torch.randn(2, 64, generator=g)
    tiny[0, :32] *= 1e-38  # subnormal-sized: 127 / max overflows
    out = ops.linear(ext, tiny, [w], x_q8=True, threads=2)
    assert torch.isfinite(out).all()
    if ext.q8_dot():
        kept = tiny.clone()
        kept[0, :32] = 0
        ref = q8_codes(kept) @ w.dequantize().double().T
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


def test_q8_codes_one_row_sums_as_a_batch_row_does(ext: ModuleType) -> None:
    """A row's codes depend on that row only: a decode step's token sums as it would in a batch."""
    g = torch.Generator().manual_seed(5)
    w = make_weight("q8_0", 45, 576, g)
    x = torch.randn(5, 576, generator=g)
    x[2] *= 100  # another row's scale must not matter
    batch = ops.linear(ext, x, [w], x_q8=True, threads=2)
    for i in range(x.shape[0]):
        assert torch.equal(ops.linear(ext, x[i : i + 1], [w], x_q8=True, threads=2), batch[i : i + 1])


def test_q8_codes_keep_nan_and_full_range_weights(ext: ModuleType) -> None:
    """A NaN or an infinity in x makes its row NaN (as fp32 x would: it has no int8 code), other
    rows stay exact; a weight code of -128 (GGUF Q8_0 allows it) meets the largest x codes
    without the pairwise int16 sums saturating."""
    g = torch.Generator().manual_seed(6)
    k = 64
    data = torch.full((3, k), -128, dtype=torch.int8)
    data[1] = 127
    data[2] = torch.randint(-128, 128, (k,), generator=g, dtype=torch.int8)
    w = Weight(data, torch.full((3, k // 32), 0.5, dtype=torch.float16))
    x = torch.ones(4, k)
    x[1] = -1.0
    x[2, 7], x[3, 40] = float("nan"), float("inf")
    got = ops.linear(ext, x, [w], x_q8=True, threads=2)
    ref = x[:2].double() @ w.dequantize().double().T
    torch.testing.assert_close(got[:2].double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.isnan(got[2]).all() and not torch.isfinite(got[3]).any()


@pytest.mark.parametrize("kind", KINDS)
def test_fused_qkv_bias_and_accumulate(ext: ModuleType, kind: str) -> None:
    g = torch.Generator().manual_seed(1)
    ws = [make_weight(kind, n, 64, g) for n in (48, 16, 16)]
    ws[1] = Weight(ws[1].data, ws[1].scales, ws[1].mins, torch.randn(16, generator=g))
    x = torch.randn(7, 64, generator=g)
    ref = torch.cat([x @ w.dequantize().T for w in ws], dim=1)
    ref[:, 48:64] += ws[1].bias  # type: ignore[operator]
    got = ops.linear(ext, x, ws, threads=2)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)
    base = torch.randn(7, 80, generator=g)
    acc = ops.linear(ext, x, ws, base.clone(), accumulate=True, threads=2)
    torch.testing.assert_close(acc, base + ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_swiglu_epilogue(ext: ModuleType, kind: str) -> None:
    g = torch.Generator().manual_seed(2)
    gate, up = make_weight(kind, 50, 64, g), make_weight(kind, 50, 64, g)
    x = torch.randn(5, 64, generator=g)
    ref = F.silu(x @ gate.dequantize().T) * (x @ up.dequantize().T)
    got = ops.linear(ext, x, [gate, up], swiglu=True, threads=2)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)


def test_bf16_rounding_matches_the_torch_path(ext: ModuleType) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 64, generator=g).bfloat16()
    x = torch.randn(3, 64, generator=g).bfloat16()
    res = torch.randn(3, 40, generator=g).bfloat16()
    got = ops.linear(ext, x.float(), [Weight(w)], res.float(), accumulate=True, round_bf16=True)
    ref = res + F.linear(x, w)
    assert got.bfloat16().float().equal(got)  # every value is a bf16
    torch.testing.assert_close(got, ref.float(), rtol=1e-2, atol=1e-2)
    a, b = F.linear(x, w).float(), F.linear(x, Weight(w).dequantize().bfloat16()).float()
    assert (a - b).abs().max() == 0  # the reference itself is deterministic
    gate, up = torch.randn(40, 64, generator=g).bfloat16(), torch.randn(40, 64, generator=g).bfloat16()
    swi = ops.linear(ext, x.float(), [Weight(gate), Weight(up)], swiglu=True, round_bf16=True)
    ref2 = F.silu(F.linear(x, gate)) * F.linear(x, up)
    torch.testing.assert_close(swi, ref2.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("k", [64, 96, 83])  # whole 64s, a 32 tail, a ragged tail
def test_bf16_dot_products_of_bf16_activations(ext: ModuleType, m: int, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    w = Weight(torch.randn(37, k, generator=g).bfloat16())
    x = torch.randn(m, k, generator=g).bfloat16().float()  # bf16 values, as a bf16 model has
    got = ops.linear(ext, x, [w], x_bf16=True, threads=2)
    ref = x.double() @ w.dequantize().double().T
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("k", [576, 96, 83])
def test_one_row_of_bf16_activations_sums_as_a_batch_row_does(ext: ModuleType, k: int) -> None:
    # A decode step (one row) has its own bf16 tile on AVX-512; greedy decoding must not depend
    # on whether a token ran alone or in a batch, so its sums are the batch path's, exactly.
    g = torch.Generator().manual_seed(k)
    w = Weight(torch.randn(45, k, generator=g).bfloat16())
    x = torch.randn(5, k, generator=g).bfloat16().float()
    batch = ops.linear(ext, x, [w], x_bf16=True, threads=2)
    for i in range(x.shape[0]):
        assert torch.equal(ops.linear(ext, x[i : i + 1], [w], x_bf16=True, threads=2), batch[i : i + 1])


def test_rms_norm(ext: ModuleType) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 96, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(96, generator=g).to(dtype)
        rnd = dtype == torch.bfloat16
        xin = x.to(dtype)
        ref = F.rms_norm(xin.float(), (96,), eps=1e-5).to(dtype) * w
        got = ops.rms_norm(ext, xin.float(), w, 1e-5, round_bf16=rnd)
        torch.testing.assert_close(got, ref.float(), rtol=1e-2 if rnd else 1e-5, atol=1e-2 if rnd else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_rotate_half(ext: ModuleType, dtype: torch.dtype) -> None:
    from runtime.models.llama import _apply_rope

    g = torch.Generator().manual_seed(5)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    cos, sin = ops.rope_table(inv, 300)
    pos = torch.tensor([0, 5, 299, 17])
    x = torch.randn(4, 3, 64, generator=g).to(dtype)
    freqs = pos.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    ref = _apply_rope(x, emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :])
    got = x.float().contiguous()
    ops.rope(ext, got, pos, cos, sin, round_bf16=dtype == torch.bfloat16)
    assert torch.equal(got, ref.float())  # the same roundings in the same order: bit-exact
    with pytest.raises(CpuKernelError, match="outside"):
        ops.rope(ext, got, torch.tensor([0, 1, 2, 300]), cos, sin)


# Head sizes the attention tests run: the AVX2 path has a copy of its kernel for heads of 64
# (SmolLM2's); every other size takes the general one.
HEAD_DIMS = [64, 128]


def paged_cache(
    dtype: torch.dtype, g: torch.Generator, num_blocks: int = 12, pad: int = 0, bs: int = 4, d: int = 64
) -> torch.Tensor:
    """(NB, L=2, 2, BS=bs, H_kv=2, D=d) with ``pad`` elements between blocks (a pool view)."""
    inner = 2 * 2 * bs * 2 * d
    flat = torch.randn(num_blocks * (inner + pad), generator=g).to(dtype)
    strides = (inner + pad, 2 * bs * 2 * d, bs * 2 * d, 2 * d, d, 1)
    return flat.as_strided((num_blocks, 2, 2, bs, 2, d), strides)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_lands_in_the_slot(ext: ModuleType, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    kv = paged_cache(dtype, g, pad=40)
    before = kv.clone()
    slots = torch.tensor([13, 2, 47])
    k, v = torch.randn(3, 2, 64, generator=g), torch.randn(3, 2, 64, generator=g)
    ops.kv_write(ext, kv, 1, k, v, slots)
    expect = before.clone()
    expect[slots // 4, 1, 0, slots % 4] = k.to(dtype)
    expect[slots // 4, 1, 1, slots % 4] = v.to(dtype)
    assert torch.equal(kv, expect)


def reference_attention(
    q: torch.Tensor, kv: torch.Tensor, layer: int, table: list[int], ctx: int
) -> torch.Tensor:
    bs = kv.shape[3]
    k = kv[table, layer, 0].reshape(-1, kv.shape[4], kv.shape[5])[:ctx].float()  # (T, Hkv, D)
    v = kv[table, layer, 1].reshape(-1, kv.shape[4], kv.shape[5])[:ctx].float()
    assert len(table) * bs >= ctx
    o = F.scaled_dot_product_attention(
        q[:, None].double(), k.transpose(0, 1).double(), v.transpose(0, 1).double(), enable_gqa=True
    )  # (H, 1, D)
    return o.reshape(-1).float()


def check_attention(
    ext: ModuleType,
    q: torch.Tensor,
    kv: torch.Tensor,
    tables: torch.Tensor,
    ctx: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """Layer 1's paged attention of every query row against :func:`reference_attention`."""
    got = ops.paged_decode_attention(ext, q, kv, 1, tables, ctx, rows, threads=2)
    bs = kv.shape[3]
    for i in range(q.shape[0]):
        nb = -(-int(ctx[i]) // bs)
        ref = reference_attention(q[i], kv, 1, tables[rows[i], :nb].tolist(), int(ctx[i]))
        torch.testing.assert_close(got[i], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [2, 6])  # MHA and GQA (3 query heads per KV head)
@pytest.mark.parametrize("q_scale", [1.0, 40.0])  # 40: scores hundreds apart, most weights underflow
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_paged_attention_reads_blocks_in_place(
    ext: ModuleType, dtype: torch.dtype, heads: int, q_scale: float, d: int
) -> None:
    g = torch.Generator().manual_seed(7)
    kv = paged_cache(dtype, g, pad=8, d=d)
    kv[0].fill_(float("nan"))  # block 0 is in no table: stale bytes must not leak
    tables = torch.tensor([[7, 3, 9, 1, 6], [2, 11, 5, 0, 0], [4, 0, 0, 0, 0]])  # out of order
    ctx = torch.tensor([17, 9, 1, 10])  # end mid-block; the last row reuses sequence 1
    rows = torch.tensor([0, 1, 2, 1])
    q = torch.randn(4, heads, d, generator=g) * q_scale
    check_attention(ext, q, kv, tables, ctx, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_scale", [1.0, 40.0])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_paged_attention_in_blocks_of_16(ext: ModuleType, dtype: torch.dtype, q_scale: float, d: int) -> None:
    # SmolLM2's block size: the vector paths turn a block's scores into weights 8 or 16 at a
    # time, with a tail (blocks of 4 above never fill a vector).
    g = torch.Generator().manual_seed(9)
    kv = paged_cache(dtype, g, num_blocks=8, pad=8, bs=16, d=d)
    tables = torch.tensor([[5, 2, 7, 0], [1, 6, 3, 0]])
    ctx = torch.tensor([41, 16, 9, 48])  # tails of 9 and 1, a whole block, one block of 9, three whole
    rows = torch.tensor([0, 1, 1, 0])
    q = torch.randn(4, 6, d, generator=g) * q_scale
    check_attention(ext, q, kv, tables, ctx, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token", [3, 20])  # among a block's first 16 scores, in a block's tail
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_a_nan_in_the_context_is_not_hidden(ext: ModuleType, dtype: torch.dtype, token: int, d: int) -> None:
    # A vector exp that clamps its input before the polynomial turned a NaN score into a weight
    # of ~0 (AVX2) or ~e^88 (AVX-512): the head's output came out finite, where torch and the
    # portable path give NaN.
    g = torch.Generator().manual_seed(10)
    kv = paged_cache(dtype, g, num_blocks=4, bs=16, d=d)
    tables = torch.tensor([[1, 2]])
    kv[tables[0, token // 16], 1, 0, token % 16, 0, 5] = float("nan")  # K of KV head 0
    q = torch.randn(1, 2, d, generator=g)  # head 0 reads KV head 0, head 1 KV head 1
    got = ops.paged_decode_attention(ext, q, kv, 1, tables, torch.tensor([21]), torch.tensor([0]), threads=1)
    heads = got.reshape(2, d)
    assert heads[0].isnan().all()
    assert heads[1].isfinite().all()


@pytest.mark.parametrize("kind", KINDS)
def test_embedding_rows(ext: ModuleType, kind: str) -> None:
    g = torch.Generator().manual_seed(8)
    w = make_weight(kind, 20, 64, g)
    ids = torch.tensor([3, 0, 19, 3])
    assert torch.equal(ops.embedding(ext, w, ids), w.dequantize()[ids])


def test_bad_inputs_fail_loudly() -> None:
    assert _EXT is not None
    with pytest.raises(CpuKernelError, match="EMBER_CPU_KERNELS"):
        ops.load("fast")
    with pytest.raises(ValueError, match=r"1\.\.3 weights"):
        _EXT.linear(1, 0, 1, 0, 1, 1, 1, 0, 1, 0, 0)
    with pytest.raises(TypeError, match="takes 11 arguments"):
        _EXT.linear(1, 2, 3)
    with pytest.raises(CpuKernelError, match="in_features % 32"):
        Weight(torch.zeros(4, 40, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.float16))
    assert ops.load("off") is None


def test_auto_takes_the_best_path_this_cpu_runs() -> None:
    assert AVAILABLE[0] == "generic"
    mod = ops.load("auto")
    assert mod is not None and mod.isa() == AVAILABLE[-1]
    for isa in ("avx2", "avx512"):
        if isa not in AVAILABLE:
            with pytest.raises(CpuKernelError, match="lacks"):
                ops.load(isa)
    assert mod.isa() == AVAILABLE[-1]  # a refused choice leaves the path as it was


def test_one_openmp_runtime_is_mapped() -> None:
    from pathlib import Path

    maps = Path("/proc/self/maps").read_text().splitlines()
    libs = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(libs) == 1, libs


@dataclass
class Step:
    """One decode step's inputs for layer 1 of a paged_cache: E=128, H=4, Hkv=2, D=64, I=96, 3 rows."""

    weights: list[Weight]  # what the descriptors below point into: kept alive with them
    kv: torch.Tensor
    x: torch.Tensor
    qkv: torch.Tensor  # descriptors
    o: torch.Tensor
    mlp: torch.Tensor
    down: torch.Tensor
    norms: tuple[torch.Tensor, torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor = field(default_factory=lambda: torch.tensor([5, 9, 2]))
    slots: torch.Tensor = field(default_factory=lambda: torch.tensor([5 + 4, 9 + 8, 2 + 24]))  # in the tables
    tables: torch.Tensor = field(default_factory=lambda: torch.tensor([[3, 1, 0], [7, 11, 2], [6, 0, 0]]))
    ctx: torch.Tensor = field(default_factory=lambda: torch.tensor([6, 10, 3]))
    n, e, h, hkv, d, inter = 3, 128, 4, 2, 64, 96

    @classmethod
    def random(cls, g: torch.Generator, kv_dtype: torch.dtype) -> Step:
        e, h, hkv, d, inter = cls.e, cls.h, cls.hkv, cls.d, cls.inter

        def weight(rows: int, cols: int) -> Weight:
            return Weight(torch.randn(rows, cols, generator=g).div(cols**0.5).bfloat16())

        cos, sin = ops.rope_table(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), 64)
        qkv = [weight(h * d, e), weight(hkv * d, e), weight(hkv * d, e)]
        o, mlp, down = weight(e, h * d), [weight(inter, e), weight(inter, e)], weight(e, inter)
        return cls(
            [*qkv, o, *mlp, down],
            paged_cache(kv_dtype, g, pad=8),
            torch.randn(cls.n, e, generator=g).bfloat16().float(),
            ops.descriptors(qkv),
            ops.descriptors([o]),
            ops.descriptors(mlp),
            ops.descriptors([down]),
            (torch.rand(e, generator=g).add(0.5).bfloat16(), torch.rand(e, generator=g).add(0.5).bfloat16()),
            cos,
            sin,
        )

    def layer(self, kv: torch.Tensor) -> list[int]:
        """The layer's row of decoder_layers' table."""
        n1, n2 = self.norms
        return [
            n1.data_ptr(), self.qkv.data_ptr(), self.o.data_ptr(), n2.data_ptr(), self.mlp.data_ptr(),
            self.down.data_ptr(), KVLayout.of(kv, 1).address,
        ]  # fmt: skip

    def run(
        self, ext: ModuleType, table: torch.Tensor, kv: torch.Tensor, x: torch.Tensor, nlayers: int = 1,
        ctx: torch.Tensor | None = None, inter: int | None = None,
    ) -> None:  # fmt: skip
        lay, n, d, h, hkv = KVLayout.of(kv, 1), self.n, self.d, self.h, self.hkv
        scratch = [x, *(torch.empty(n, c) for c in (self.e, (h + 2 * hkv) * d, h * d, self.inter))]
        rows, ctx = torch.arange(n), self.ctx if ctx is None else ctx
        ext.decoder_layers(
            2, table.data_ptr(), nlayers, n, self.e, h, hkv, d, self.inter if inter is None else inter,
            *(t.data_ptr() for t in scratch), self.positions.data_ptr(), self.slots.data_ptr(),
            self.tables.data_ptr(), self.tables.shape[1], rows.data_ptr(), ctx.data_ptr(),
            self.cos.data_ptr(), self.sin.data_ptr(), ops.BF16, lay.dtype, lay.block_stride, lay.block_size,
            1e-5, d**-0.5, ops.X_BF16 | ops.ROUND_BF16, 1,
        )  # fmt: skip


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decoder_layers_equal_the_kernels_one_by_one(ext: ModuleType, kv_dtype: torch.dtype) -> None:
    # runtime.models.llama_decode runs a step's layers in one call; it must compute exactly what
    # the nine kernels of a layer compute when called one after another.
    s = Step.random(torch.Generator().manual_seed(11), kv_dtype)
    n, e, h, hkv, d, inter = s.n, s.e, s.h, s.hkv, s.d, s.inter
    qkv_w, flags, rows = (h + 2 * hkv) * d, ops.X_BF16 | ops.ROUND_BF16, torch.arange(n)
    kv0, x0 = s.kv.clone(), s.x.clone()
    lay = KVLayout.of(kv0, 1)
    hb, qkv, attn, mlp = (torch.empty(n, c) for c in (e, qkv_w, h * d, inter))
    xp, hp, qp, ap, mp = (t.data_ptr() for t in (x0, hb, qkv, attn, mlp))
    cache = (lay.address, lay.dtype, lay.block_stride, lay.block_size)
    ext.rms_norm(xp, e, 0, hp, e, s.norms[0].data_ptr(), ops.BF16, n, e, 1e-5, 1)
    ext.linear(2, s.qkv.data_ptr(), 3, hp, e, n, e, qp, qkv_w, flags, 0)
    ext.rope(qp, qkv_w, h + hkv, d, s.positions.data_ptr(), n, s.cos.data_ptr(), s.sin.data_ptr(), 1)
    ext.kv_write(qp + h * d * 4, qp + (h + hkv) * d * 4, qkv_w, *cache, hkv * d, s.slots.data_ptr(), n)
    ext.paged_decode_attention(
        2, qp, qkv_w, *cache, h, hkv, d, s.tables.data_ptr(), s.tables.shape[1], rows.data_ptr(),
        s.ctx.data_ptr(), n, ap, h * d, d**-0.5, 1,
    )  # fmt: skip
    ext.linear(2, s.o.data_ptr(), 1, ap, h * d, n, h * d, xp, e, flags | ops.ACCUMULATE, 0)
    ext.rms_norm(xp, e, 0, hp, e, s.norms[1].data_ptr(), ops.BF16, n, e, 1e-5, 1)
    ext.linear(2, s.mlp.data_ptr(), 2, hp, e, n, e, mp, inter, flags, 1)
    ext.linear(2, s.down.data_ptr(), 1, mp, inter, n, inter, xp, e, flags | ops.ACCUMULATE, 0)

    kv1, x1 = s.kv.clone(), s.x.clone()
    s.run(ext, torch.tensor([s.layer(kv1)]), kv1, x1)
    assert torch.equal(x0, x1)
    assert torch.equal(kv0.float(), kv1.float())
    assert not torch.equal(x1, s.x)  # the layer did something


def test_decoder_layers_refuse_bad_steps() -> None:
    assert _EXT is not None
    s = Step.random(torch.Generator().manual_seed(12), torch.bfloat16)
    good = s.layer(s.kv)
    with pytest.raises(ValueError, match="positive sizes"):
        s.run(_EXT, torch.tensor([good]), s.kv, s.x.clone(), nlayers=0)
    with pytest.raises(ValueError, match="every context"):
        s.run(_EXT, torch.tensor([good]), s.kv, s.x.clone(), ctx=torch.tensor([6, 13, 3]))  # > 3 blocks of 4
    with pytest.raises(ValueError, match="model's shapes"):  # gate/up have 96 rows, not 64
        s.run(_EXT, torch.tensor([good]), s.kv, s.x.clone(), inter=64)
    with pytest.raises(ValueError, match="norm weights"):
        s.run(_EXT, torch.tensor([[*good[:6], 0]]), s.kv, s.x.clone())
