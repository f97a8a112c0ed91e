/* The AVX-512 path (F, BW, VL, DQ, BF16 with FMA and F16C), chosen at import when the CPU has it.
 *
 * Every weight tile is up to 4 rows of W against up to 4 rows of x: each weight vector loaded
 * from memory feeds MC FMAs, so a batch of M rows streams the weights once (the tile stays in
 * L1/L2 while the driver walks x in chunks of 4). Weights are widened to fp32 in registers; the
 * activations stay fp32, so results equal the portable path up to summation order. */
#include "ck.h"

#ifdef CK_HAVE_X86_PATHS /* x86-64 with GCC or Clang; elsewhere only the portable path exists */
#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

INLINE AVX512 __m512 ld_bf16(const uint16_t *p) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

INLINE AVX512 __m512 ld_bf16_tail(const uint16_t *p, __mmask16 mk) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

/* Rows are read one after another, each front to back, so the weights stream through memory
 * in address order, which the hardware prefetcher follows best: walking 4 rows side by side
 * ran at a third of the bandwidth, and software prefetching 0.5-4 KiB ahead only slowed this
 * order down (measured on Zen 4). Two accumulators per row of x hide the FMA latency; the x
 * rows (at most 4) stay in L1. */

INLINE AVX512 float hsum2(__m512 a, __m512 b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }

/* ---- fp32 and bf16 weights: any K (a masked tail) ----------------------------------------- */

INLINE AVX512 __m512 ld_w(const void *w, int bf16, i64 off) {
    return bf16 ? ld_bf16((const uint16_t *)w + off) : _mm512_loadu_ps((const float *)w + off);
}

INLINE AVX512 void row_float(const void *w, int bf16, i64 row, const ck_act *a, i64 m0, int MC, i64 k,
                             float *res) {
    __m512 acc0[4], acc1[4];
    for (int m = 0; m < 4; m++) acc0[m] = acc1[m] = _mm512_setzero_ps();
    const float *x = a->x + m0 * a->ldx;
    i64 base = row * k, i = 0;
    for (; i + 32 <= k; i += 32) {
        __m512 w0 = ld_w(w, bf16, base + i), w1 = ld_w(w, bf16, base + i + 16);
        for (int m = 0; m < MC; m++) {
            acc0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * a->ldx + i), acc0[m]);
            acc1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * a->ldx + i + 16), acc1[m]);
        }
    }
    for (; i < k; i += 16) {
        __mmask16 mk = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);
        __m512 wv = bf16 ? ld_bf16_tail((const uint16_t *)w + base + i, mk)
                         : _mm512_maskz_loadu_ps(mk, (const float *)w + base + i);
        for (int m = 0; m < MC; m++)
            acc0[m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mk, x + m * a->ldx + i), acc0[m]);
    }
    for (int m = 0; m < MC; m++) res[m] = hsum2(acc0[m], acc1[m]);
}

/* bf16 weights against bf16-exact x (CK_X_BF16): vdpbf16ps multiplies pairs exactly and sums
 * in fp32, 32 weights per instruction and no widening. K's tail: masked loads give zero pairs. */
INLINE AVX512 void row_bf16dp(const uint16_t *w, i64 row, const ck_act *a, i64 m0, int MC, i64 k,
                              float *res) {
    __m512 acc0[4], acc1[4];
    for (int m = 0; m < 4; m++) acc0[m] = acc1[m] = _mm512_setzero_ps();
    const uint16_t *wr = w + row * k, *xb = a->xbf + m0 * k;
    i64 i = 0;
    for (; i + 64 <= k; i += 64) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + i), w1 = (__m512bh)_mm512_loadu_si512(wr + i + 32);
        for (int m = 0; m < MC; m++) {
            acc0[m] = _mm512_dpbf16_ps(acc0[m], w0, (__m512bh)_mm512_loadu_si512(xb + m * k + i));
            acc1[m] = _mm512_dpbf16_ps(acc1[m], w1, (__m512bh)_mm512_loadu_si512(xb + m * k + i + 32));
        }
    }
    for (; i < k; i += 32) {
        __mmask32 mk = k - i >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (k - i)) - 1);
        __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mk, wr + i);
        for (int m = 0; m < MC; m++)
            acc0[m] = _mm512_dpbf16_ps(acc0[m], wv, (__m512bh)_mm512_maskz_loadu_epi16(mk, xb + m * k + i));
    }
    for (int m = 0; m < MC; m++) res[m] = hsum2(acc0[m], acc1[m]);
}

/* ---- q8_0: 32 int8 per group, one fp16 scale; two groups (a cache line) per step ---------- */

INLINE AVX512 __m512 q8_dot(const int8_t *q, const float *x) {
    __m512 ql = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    __m512 qh = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    return _mm512_fmadd_ps(qh, _mm512_loadu_ps(x + 16), _mm512_mul_ps(ql, _mm512_loadu_ps(x)));
}

INLINE AVX512 void row_q8_0(const ck_weight *w, i64 row, const ck_act *a, i64 m0, int MC, i64 k, float *res) {
    __m512 acc0[4], acc1[4];
    for (int m = 0; m < 4; m++) acc0[m] = acc1[m] = _mm512_setzero_ps();
    const float *x = a->x + m0 * a->ldx;
    i64 groups = k / CK_GROUP, g = 0;
    const int8_t *q = (const int8_t *)w->data + row * k;
    const uint16_t *sc = (const uint16_t *)w->scales + row * groups;
    for (; g + 2 <= groups; g += 2) {
        __m512 s0 = _mm512_set1_ps(_cvtsh_ss(sc[g])), s1 = _mm512_set1_ps(_cvtsh_ss(sc[g + 1]));
        for (int m = 0; m < MC; m++) {
            const float *xm = x + m * a->ldx + g * CK_GROUP;
            acc0[m] = _mm512_fmadd_ps(q8_dot(q + g * CK_GROUP, xm), s0, acc0[m]);
            acc1[m] = _mm512_fmadd_ps(q8_dot(q + (g + 1) * CK_GROUP, xm + CK_GROUP), s1, acc1[m]);
        }
    }
    if (g < groups) {
        __m512 s0 = _mm512_set1_ps(_cvtsh_ss(sc[g]));
        for (int m = 0; m < MC; m++)
            acc0[m] = _mm512_fmadd_ps(q8_dot(q + g * CK_GROUP, x + m * a->ldx + g * CK_GROUP), s0, acc0[m]);
    }
    for (int m = 0; m < MC; m++) res[m] = hsum2(acc0[m], acc1[m]);
}

/* ---- q4_1: 16 bytes per group (low nibble = even k), fp16 scale and min; four groups per step */

INLINE AVX512 __m512 q4_dot(const uint8_t *q, const float *xp) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    __m512 qe = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    __m512 qo = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    return _mm512_fmadd_ps(qo, _mm512_loadu_ps(xp + 16), _mm512_mul_ps(qe, _mm512_loadu_ps(xp)));
}

INLINE AVX512 void row_q4_1(const ck_weight *w, i64 row, const ck_act *a, i64 m0, int MC, i64 k, float *res) {
    __m512 acc0[4], acc1[4];
    for (int m = 0; m < 4; m++) acc0[m] = acc1[m] = _mm512_setzero_ps();
    i64 groups = k / CK_GROUP, g = 0;
    const float *xp = a->xperm + m0 * k;
    const uint8_t *q = (const uint8_t *)w->data + row * (k / 2);
    const uint16_t *sc = (const uint16_t *)w->scales + row * groups;
    const uint16_t *mn = (const uint16_t *)w->mins + row * groups;
    for (; g + 2 <= groups; g += 2) {
        __m512 s0 = _mm512_set1_ps(_cvtsh_ss(sc[g])), s1 = _mm512_set1_ps(_cvtsh_ss(sc[g + 1]));
        for (int m = 0; m < MC; m++) {
            const float *xm = xp + m * k + g * CK_GROUP;
            acc0[m] = _mm512_fmadd_ps(q4_dot(q + g * (CK_GROUP / 2), xm), s0, acc0[m]);
            acc1[m] = _mm512_fmadd_ps(q4_dot(q + (g + 1) * (CK_GROUP / 2), xm + CK_GROUP), s1, acc1[m]);
        }
    }
    if (g < groups) {
        __m512 s0 = _mm512_set1_ps(_cvtsh_ss(sc[g]));
        for (int m = 0; m < MC; m++)
            acc0[m] = _mm512_fmadd_ps(q4_dot(q + g * (CK_GROUP / 2), xp + m * k + g * CK_GROUP), s0, acc0[m]);
    }
    for (int m = 0; m < MC; m++) {
        const float *xs = a->xsum + (m0 + m) * groups;
        float mins = 0.f; /* sum over groups of min * sum(x of the group) */
        for (i64 j = 0; j < groups; j++) mins += _cvtsh_ss(mn[j]) * xs[j];
        res[m] = hsum2(acc0[m], acc1[m]) + mins;
    }
}

#define ROW_F32(mc) row_float((const void *)w->data, 0, r0 + r, a, m0, mc, k, t)
#define ROW_BF16(mc)                                                               \
    (a->xbf ? row_bf16dp((const uint16_t *)w->data, r0 + r, a, m0, mc, k, t)      \
            : row_float((const void *)w->data, 1, r0 + r, a, m0, mc, k, t))
#define ROW_Q8_0(mc) row_q8_0(w, r0 + r, a, m0, mc, k, t)
#define ROW_Q4_1(mc) row_q4_1(w, r0 + r, a, m0, mc, k, t)
CK_TILE(AVX512, tile_f32, ROW_F32)
CK_TILE(AVX512, tile_bf16_rows, ROW_BF16)

/* A decode step's bf16 tile (one row of bf16-exact x, MC = 1): each row's dot product inline,
 * rows one after another, with row_bf16dp's accumulators and order (equal results). Through
 * the generic tile (a switch, an accumulator array and a copy per row) a step's bf16 linears
 * took 8-15 % longer on Zen 5: with K = 576 a row is 9 iterations, so per-row overhead shows. */
INLINE AVX512 float dot1_bf16(const uint16_t *wr, const uint16_t *xb, i64 k) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    i64 i = 0;
    for (; i + 64 <= k; i += 64) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(wr + i), (__m512bh)_mm512_loadu_si512(xb + i));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(wr + i + 32),
                              (__m512bh)_mm512_loadu_si512(xb + i + 32));
    }
    for (; i < k; i += 32) {
        __mmask32 mk = k - i >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (k - i)) - 1);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(mk, wr + i),
                              (__m512bh)_mm512_maskz_loadu_epi16(mk, xb + i));
    }
    return hsum2(a0, a1);
}

static AVX512 void tile_bf16(const ck_weight *w, i64 r0, int R, const ck_act *a, i64 m0, int MC, i64 k,
                             float *res) {
    if (MC != 1 || !a->xbf) {
        /* More than 4 rows of x: the driver runs this tile once per 4 rows, the later passes from
         * L1, and while they run nothing asks memory for the weights that come next, so the
         * next tile's first pass waited on them (perf: half of a batch-8 step's samples in this
         * tile sat on its weight loads). Its first pass asks for the next tile's rows now.
         * Raw engine, SmolLM2 bf16, batch 8, 6 runs in turns: 362-423 -> 382-568 tok/s (p50
         * ~396 -> ~505). At most 4 rows of x (a decode step's batch of <= 4) is one pass and
         * streams as before. */
        if (m0 == 0 && a->m > 4) {
            const char *next = (const char *)((const uint16_t *)w->data + (r0 + R) * k);
            for (i64 b = 0; b < (i64)R * k * 2; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
        }
        tile_bf16_rows(w, r0, R, a, m0, MC, k, res);
        return;
    }
    const uint16_t *wr = (const uint16_t *)w->data + r0 * k, *xb = a->xbf + m0 * k;
    for (int r = 0; r < R; r++) res[r * 4] = dot1_bf16(wr + r * k, xb, k);
}

CK_TILE(AVX512, tile_q8_0, ROW_Q8_0)
CK_TILE(AVX512, tile_q4_1, ROW_Q4_1)

/* ---- attention: one query head, K/V read in place from the blocks -------------------------- */

INLINE AVX512 __m512 ld_kv(const char *kv, int bf16, i64 off) {
    return bf16 ? ld_bf16((const uint16_t *)kv + off) : _mm512_loadu_ps((const float *)kv + off);
}

/* e^x of 16 floats: Cephes' expf (x = n ln2 + r, ln2 split in two for the reduction, a degree-5
 * polynomial for e^r, 2^n by scalef), within 2 ulp of libm's expf. A libm call per context
 * token made an attention call (9 heads, ctx 40-200) 15-18 % slower. */
INLINE AVX512 __m512 exp16(__m512 x) {
    /* min/max return their second operand when either is NaN: a NaN stays NaN, as expf's does */
    x = _mm512_max_ps(_mm512_set1_ps(-103.972694f), _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(y, n);
}

static AVX512 void attn(const ck_attn *a, const float *q, const i64 *table, i64 ctx, i64 kv_head, float *out) {
    i64 d = a->d, bs = a->bs;
    if (d % 16 || d > 512) {
        ck_generic_isa.attn(a, q, table, ctx, kv_head, out);
        return;
    }
    int bf16 = a->kv_dtype == CK_BF16;
    int nv = (int)(d / 16);
    __m512 acc[32], qv[32];
    for (int j = 0; j < nv; j++) {
        acc[j] = _mm512_setzero_ps();
        qv[j] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * j), _mm512_set1_ps(a->scale));
    }
    float s[512], mx = -INFINITY, l = 0.f;
    for (i64 j0 = 0; j0 < ctx; j0 += bs) {
        i64 n = ctx - j0 < bs ? ctx - j0 : bs;
        i64 base = table[j0 / bs] * a->block_stride + kv_head * d;
        float bm = -INFINITY;
        for (i64 t = 0; t < n; t++) {
            i64 off = base + t * a->token_stride;
            __m512 dot = _mm512_setzero_ps();
            for (int j = 0; j < nv; j++) dot = _mm512_fmadd_ps(qv[j], ld_kv(a->kv, bf16, off + 16 * j), dot);
            s[t] = _mm512_reduce_add_ps(dot);
            bm = s[t] > bm ? s[t] : bm;
        }
        float nm = bm > mx ? bm : mx;
        __m512 c = _mm512_set1_ps(expf(mx - nm));
        l *= expf(mx - nm);
        for (int j = 0; j < nv; j++) acc[j] = _mm512_mul_ps(acc[j], c);
        __m512 psum = _mm512_setzero_ps();
        for (i64 t0 = 0; t0 < n; t0 += 16) { /* s[t] becomes the weight e^(s[t] - nm) */
            __mmask16 mk = n - t0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t0)) - 1);
            __m512 pw = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + t0), _mm512_set1_ps(nm)));
            psum = _mm512_add_ps(psum, _mm512_maskz_mov_ps(mk, pw));
            _mm512_mask_storeu_ps(s + t0, mk, pw);
        }
        l += _mm512_reduce_add_ps(psum);
        for (i64 t = 0; t < n; t++) {
            __m512 pv = _mm512_set1_ps(s[t]);
            i64 off = base + a->v_offset + t * a->token_stride;
            for (int j = 0; j < nv; j++) acc[j] = _mm512_fmadd_ps(pv, ld_kv(a->kv, bf16, off + 16 * j), acc[j]);
        }
        mx = nm;
    }
    __m512 inv = _mm512_set1_ps(1.f / l);
    for (int j = 0; j < nv; j++) _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(acc[j], inv));
}

const ck_isa ck_avx512_isa = {"avx512", {tile_f32, tile_bf16, tile_q8_0, tile_q4_1}, attn, 1, 0};
#endif
