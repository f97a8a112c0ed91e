/* The AVX2 path (AVX2 with FMA and F16C: x86-64-v3, every x86-64 CPU since Haswell and Zen 1),
 * chosen at import when the CPU lacks the AVX-512 path's features (AMD before Zen 4, Intel
 * client parts, most cloud VMs of those).
 *
 * Why it exists: the portable path's dot products are float sums the compiler may not reorder
 * (no -ffast-math: results must not depend on the build), so it runs scalar. On a Zen 3 VM
 * (2 cores) SmolLM2-135M bf16 decoded 11.5 tok/s through it, half of eager PyTorch's 23.6.
 *
 * The same tiles as avx512.c, 8 lanes wide: up to 4 rows of W against up to 4 rows of x, each
 * weight vector loaded once feeding MC FMAs, rows streamed front to back in address order (the
 * order the hardware prefetcher follows best), two accumulators per row of x. Weights are
 * widened to fp32 in registers and x stays fp32, so results equal the portable path up to
 * summation order, except for q8_0 weights under CK_X_Q8: those meet x as int8 codes in
 * integer dot products (ck.h), as llama.cpp's Q8_0 does, at about half the instructions. There is no bf16 dot instruction here: bf16 weights always take the
 * widening path (bf16_dot = 0), whose sums for one row of x do not depend on how many rows
 * the call has (a decode step's token sums as it would in a batch). K's tail (K % 8) is
 * summed in scalar code after the vectors. */
#include "ck.h"

#ifdef CK_HAVE_X86_PATHS /* x86-64 with GCC or Clang; elsewhere only the portable path exists */
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

INLINE AVX2 __m256 ld_bf16(const uint16_t *p) { /* 8 bf16 -> 8 fp32: the bits moved up 16 */
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

INLINE AVX2 float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE AVX2 float f16(uint16_t h) { return _cvtsh_ss(h); }

/* Weights are read once per step, front to back, from memory (a model is far larger than the
 * caches), so a row's loop asks for the line a page ahead of what it reads. The hardware's
 * stream prefetchers stop at 4 KiB page boundaries and restart on each of a step's ~150 small
 * matrices (SmolLM2's are 0.4-3.5 MB); the software prefetch keeps the next page on its way.
 * On a 2-core Zen 3 VM: the layers' matrices streamed at ~18 -> ~21 GB/s, and the raw engine's
 * batch-1 decode went 58 -> 67 tok/s (bf16) and 79 -> 91 tok/s (int8), medians of 4 runs in
 * turns. A prefetch past the end of the weights is harmless (prefetches do not fault). */
#define PREFETCH_BYTES 4096
INLINE AVX2 void ahead(const char *p) {
    _mm_prefetch((const char *)((uintptr_t)p + PREFETCH_BYTES), _MM_HINT_T0);
}

/* ---- fp32 and bf16 weights: any K (a scalar tail) ------------------------------------------ */

INLINE AVX2 __m256 ld_w(const void *w, int bf16, i64 off) {
    return bf16 ? ld_bf16((const uint16_t *)w + off) : _mm256_loadu_ps((const float *)w + off);
}

INLINE AVX2 void row_float(const void *w, int bf16, i64 row, const ck_act *a, i64 m0, int MC, i64 k,
                           float *res) {
    __m256 acc0[4], acc1[4];
    for (int m = 0; m < 4; m++) acc0[m] = acc1[m] = _mm256_setzero_ps();
    const float *x = a->x + m0 * a->ldx;
    i64 base = row * k, i = 0;
    for (; i + 16 <= k; i += 16) {
        ahead((const char *)w + (base + i) * (bf16 ? 2 : 4));
        __m256 w0 = ld_w(w, bf16, base + i), w1 = ld_w(w, bf16, base + i + 8);
        for (int m = 0; m < MC; m++) {
            acc0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * a->ldx + i), acc0[m]);
            acc1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * a->ldx + i + 8), acc1[m]);
        }
    }
    if (i + 8 <= k) {
        __m256 wv = ld_w(w, bf16, base + i);
        for (int m = 0; m < MC; m++) acc0[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * a->ldx + i), acc0[m]);
        i += 8;
    }
    for (int m = 0; m < MC; m++) {
        float t = hsum(_mm256_add_ps(acc0[m], acc1[m]));
        for (i64 j = i; j < k; j++) t += ck_load(w, bf16 ? CK_BF16 : CK_F32, base + j) * x[m * a->ldx + j];
        res[m] = t;
    }
}

/* ---- q8_0: 32 int8 per group, one fp16 scale; two groups (a cache line) per step ---------- */

INLINE AVX2 __m256 q8x8(const int8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

INLINE AVX2 __m256 q8_dot(const int8_t *q, const float *x) { /* one group: 4 x 8 products, summed */
    __m256 s = _mm256_mul_ps(q8x8(q), _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(q8x8(q + 8), _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(q8x8(q + 16), _mm256_loadu_ps(x + 16), s);
    return _mm256_fmadd_ps(q8x8(q + 24), _mm256_loadu_ps(x + 24), s);
}

/* With x as q8 codes (CK_X_Q8): each group's 32 int8 products summed exactly in integers
 * (|w| * (x with w's sign) as unsigned-by-signed byte pairs, no overflow: 2 * 128 * 127 < 2^15),
 * then scaled by the weight's and x's scales in fp32. Two accumulators: a decode step (one row
 * of x) would otherwise wait on one FMA chain. */
INLINE AVX2 __m256 q8q8_group(__m256i w_abs, __m256i w, const int8_t *xq) {
    __m256i x = _mm256_loadu_si256((const __m256i *)xq);
    __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

INLINE AVX2 void row_q8_0_codes(const ck_weight *w, i64 row, const ck_act *a, i64 m0, int MC, i64 k,
                                float *res) {
    __m256 acc0[4], acc1[4];
    for (int m = 0; m < 4; m++) acc0[m] = acc1[m] = _mm256_setzero_ps();
    i64 groups = k / CK_GROUP, g = 0;
    const int8_t *q = (const int8_t *)w->data + row * k, *xq = a->xq + m0 * k;
    const uint16_t *sc = (const uint16_t *)w->scales + row * groups;
    const float *xd = a->xd + m0 * groups;
    for (; g + 2 <= groups; g += 2) {
        ahead((const char *)(q + g * CK_GROUP));
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(q + g * CK_GROUP));
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(q + (g + 1) * CK_GROUP));
        __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);
        float s0 = f16(sc[g]), s1 = f16(sc[g + 1]);
        for (int m = 0; m < MC; m++) {
            const int8_t *xm = xq + m * k + g * CK_GROUP;
            const float *dm = xd + m * groups + g;
            acc0[m] = _mm256_fmadd_ps(q8q8_group(a0, w0, xm), _mm256_set1_ps(s0 * dm[0]), acc0[m]);
            acc1[m] = _mm256_fmadd_ps(q8q8_group(a1, w1, xm + CK_GROUP), _mm256_set1_ps(s1 * dm[1]), acc1[m]);
        }
    }
    if (g < groups) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(q + g * CK_GROUP));
        __m256i a0 = _mm256_sign_epi8(w0, w0);
        float s0 = f16(sc[g]);
        for (int m = 0; m < MC; m++)
            acc0[m] = _mm256_fmadd_ps(q8q8_group(a0, w0, xq + m * k + g * CK_GROUP),
                                      _mm256_set1_ps(s0 * xd[m * groups + g]), acc0[m]);
    }
    for (int m = 0; m < MC; m++) res[m] = hsum(_mm256_add_ps(acc0[m], acc1[m]));
}

INLINE AVX2 void row_q8_0(const ck_weight *w, i64 row, const ck_act *a, i64 m0, int MC, i64 k, float *res) {
    if (a->xq) {
        row_q8_0_codes(w, row, a, m0, MC, k, res);
        return;
    }
    __m256 acc0[4], acc1[4];
    for (int m = 0; m < 4; m++) acc0[m] = acc1[m] = _mm256_setzero_ps();
    const float *x = a->x + m0 * a->ldx;
    i64 groups = k / CK_GROUP, g = 0;
    const int8_t *q = (const int8_t *)w->data + row * k;
    const uint16_t *sc = (const uint16_t *)w->scales + row * groups;
    for (; g + 2 <= groups; g += 2) {
        ahead((const char *)(q + g * CK_GROUP));
        __m256 s0 = _mm256_set1_ps(f16(sc[g])), s1 = _mm256_set1_ps(f16(sc[g + 1]));
        for (int m = 0; m < MC; m++) {
            const float *xm = x + m * a->ldx + g * CK_GROUP;
            acc0[m] = _mm256_fmadd_ps(q8_dot(q + g * CK_GROUP, xm), s0, acc0[m]);
            acc1[m] = _mm256_fmadd_ps(q8_dot(q + (g + 1) * CK_GROUP, xm + CK_GROUP), s1, acc1[m]);
        }
    }
    if (g < groups) {
        __m256 s0 = _mm256_set1_ps(f16(sc[g]));
        for (int m = 0; m < MC; m++)
            acc0[m] = _mm256_fmadd_ps(q8_dot(q + g * CK_GROUP, x + m * a->ldx + g * CK_GROUP), s0, acc0[m]);
    }
    for (int m = 0; m < MC; m++) res[m] = hsum(_mm256_add_ps(acc0[m], acc1[m]));
}

/* ---- q4_1: 16 bytes per group (low nibble = even k), fp16 scale and min --------------------- */

/* One group against x permuted evens then odds (ck_act.xperm): bytes 0-7 hold evens 0-7 and
 * odds 0-7 (xp[0..8), xp[16..24)), bytes 8-15 evens 8-15 and odds 8-15 (xp[8..16), xp[24..32)). */
INLINE AVX2 __m256 q4_dot(const uint8_t *q, const float *xp) {
    __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
    __m256i lo = _mm256_set1_epi32(15);
    __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, lo)), _mm256_loadu_ps(xp));
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, lo)), _mm256_loadu_ps(xp + 8), s);
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), _mm256_loadu_ps(xp + 16), s);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), _mm256_loadu_ps(xp + 24), s);
}

INLINE AVX2 void row_q4_1(const ck_weight *w, i64 row, const ck_act *a, i64 m0, int MC, i64 k, float *res) {
    __m256 acc0[4], acc1[4];
    for (int m = 0; m < 4; m++) acc0[m] = acc1[m] = _mm256_setzero_ps();
    i64 groups = k / CK_GROUP, g = 0;
    const float *xp = a->xperm + m0 * k;
    const uint8_t *q = (const uint8_t *)w->data + row * (k / 2);
    const uint16_t *sc = (const uint16_t *)w->scales + row * groups;
    const uint16_t *mn = (const uint16_t *)w->mins + row * groups;
    for (; g + 2 <= groups; g += 2) {
        ahead((const char *)(q + g * (CK_GROUP / 2)));
        __m256 s0 = _mm256_set1_ps(f16(sc[g])), s1 = _mm256_set1_ps(f16(sc[g + 1]));
        for (int m = 0; m < MC; m++) {
            const float *xm = xp + m * k + g * CK_GROUP;
            acc0[m] = _mm256_fmadd_ps(q4_dot(q + g * (CK_GROUP / 2), xm), s0, acc0[m]);
            acc1[m] = _mm256_fmadd_ps(q4_dot(q + (g + 1) * (CK_GROUP / 2), xm + CK_GROUP), s1, acc1[m]);
        }
    }
    if (g < groups) {
        __m256 s0 = _mm256_set1_ps(f16(sc[g]));
        for (int m = 0; m < MC; m++)
            acc0[m] = _mm256_fmadd_ps(q4_dot(q + g * (CK_GROUP / 2), xp + m * k + g * CK_GROUP), s0, acc0[m]);
    }
    for (int m = 0; m < MC; m++) {
        const float *xs = a->xsum + (m0 + m) * groups;
        float mins = 0.f; /* sum over groups of min * sum(x of the group) */
        for (i64 j = 0; j < groups; j++) mins += f16(mn[j]) * xs[j];
        res[m] = hsum(_mm256_add_ps(acc0[m], acc1[m])) + mins;
    }
}

#define ROW_F32(mc) row_float((const void *)w->data, 0, r0 + r, a, m0, mc, k, t)
#define ROW_BF16(mc) row_float((const void *)w->data, 1, r0 + r, a, m0, mc, k, t)
#define ROW_Q8_0(mc) row_q8_0(w, r0 + r, a, m0, mc, k, t)
#define ROW_Q4_1(mc) row_q4_1(w, r0 + r, a, m0, mc, k, t)
CK_TILE(AVX2, tile_f32, ROW_F32)
CK_TILE(AVX2, tile_bf16, ROW_BF16)
CK_TILE(AVX2, tile_q8_0, ROW_Q8_0)
CK_TILE(AVX2, tile_q4_1, ROW_Q4_1)

/* ---- attention: one query head, K/V read in place from the blocks -------------------------- */

INLINE AVX2 __m256 ld_kv(const char *kv, int bf16, i64 off) {
    return bf16 ? ld_bf16((const uint16_t *)kv + off) : _mm256_loadu_ps((const float *)kv + off);
}

/* e^x of 8 floats, x <= 0 (a score minus the running maximum): Cephes' expf as in avx512.c,
 * 2^n built in the exponent bits. Below -87.3 (2^n would leave the normal range) a weight is 0:
 * next to the maximum's weight of 1 such a term is below fp32's resolution anyway. A NaN stays
 * NaN, as expf's does (max_ps returns its second operand when either is NaN). */
INLINE AVX2 __m256 exp8(__m256 x) {
    __m256 lo = _mm256_set1_ps(-87.3365447505531f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(lo, x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

INLINE AVX2 void attn_head(const ck_attn *a, const float *q, const i64 *table, i64 ctx, i64 kv_head,
                           float *out, int bf16, int nv) {
    i64 d = a->d, bs = a->bs;
    __m256 acc[32], qv[32];
    for (int j = 0; j < nv; j++) {
        acc[j] = _mm256_setzero_ps();
        qv[j] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * j), _mm256_set1_ps(a->scale));
    }
    float s[512], mx = -INFINITY, l = 0.f;
    for (i64 j0 = 0; j0 < ctx; j0 += bs) {
        i64 n = ctx - j0 < bs ? ctx - j0 : bs;
        i64 base = table[j0 / bs] * a->block_stride + kv_head * d;
        float bm = -INFINITY;
        for (i64 t = 0; t < n; t++) {
            i64 off = base + t * a->token_stride;
            __m256 dot = _mm256_setzero_ps();
            for (int j = 0; j < nv; j++) dot = _mm256_fmadd_ps(qv[j], ld_kv(a->kv, bf16, off + 8 * j), dot);
            s[t] = hsum(dot);
            bm = s[t] > bm ? s[t] : bm;
        }
        float nm = bm > mx ? bm : mx;
        float c = expf(mx - nm); /* exp(-inf) = 0 on the first block */
        l *= c;
        for (int j = 0; j < nv; j++) acc[j] = _mm256_mul_ps(acc[j], _mm256_set1_ps(c));
        __m256 psum = _mm256_setzero_ps();
        i64 t0 = 0;
        for (; t0 + 8 <= n; t0 += 8) { /* s[t] becomes the weight e^(s[t] - nm) */
            __m256 pw = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t0), _mm256_set1_ps(nm)));
            psum = _mm256_add_ps(psum, pw);
            _mm256_storeu_ps(s + t0, pw);
        }
        l += hsum(psum);
        for (; t0 < n; t0++) {
            s[t0] = expf(s[t0] - nm);
            l += s[t0];
        }
        for (i64 t = 0; t < n; t++) {
            __m256 pv = _mm256_set1_ps(s[t]);
            i64 off = base + a->v_offset + t * a->token_stride;
            for (int j = 0; j < nv; j++) acc[j] = _mm256_fmadd_ps(pv, ld_kv(a->kv, bf16, off + 8 * j), acc[j]);
        }
        mx = nm;
    }
    __m256 inv = _mm256_set1_ps(1.f / l);
    for (int j = 0; j < nv; j++) _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(acc[j], inv));
}

/* A head of 64 (SmolLM2, most small Llamas) gets its own copy with nv and the KV dtype known to
 * the compiler: its 8 accumulators then stay in registers instead of a stack array that each
 * context token's FMAs load and store. One thread, 9 heads over 160 tokens of bf16 KV on a Zen 3
 * VM: ~27 -> ~19 us. */
static AVX2 void attn(const ck_attn *a, const float *q, const i64 *table, i64 ctx, i64 kv_head, float *out) {
    if (a->d % 8 || a->d > 256 || a->bs > 512) {
        ck_generic_isa.attn(a, q, table, ctx, kv_head, out);
        return;
    }
    int bf16 = a->kv_dtype == CK_BF16, nv = (int)(a->d / 8);
    if (nv == 8 && bf16)
        attn_head(a, q, table, ctx, kv_head, out, 1, 8);
    else if (nv == 8)
        attn_head(a, q, table, ctx, kv_head, out, 0, 8);
    else
        attn_head(a, q, table, ctx, kv_head, out, bf16, nv);
}

const ck_isa ck_avx2_isa = {"avx2", {tile_f32, tile_bf16, tile_q8_0, tile_q4_1}, attn, 0, 1};
#endif
