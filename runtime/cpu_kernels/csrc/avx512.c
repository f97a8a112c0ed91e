/* The AVX-512 path (F, BW, VL, DQ, BF16 with FMA and F16C), chosen at import when the CPU has it.
 *
 * Every weight tile is up to 4 rows of W against up to 4 rows of x: each weight vector loaded
 * from memory feeds MC FMAs, so a batch of M rows streams the weights once (the tile stays in
 * L1 while the driver walks x in chunks of 4). Weights are widened to fp32 in registers; the
 * activations stay fp32, so results equal the portable path up to summation order. */
#include <immintrin.h>

#include "ck.h"

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

INLINE AVX512 void store_res(__m512 acc[4][4], int R, int MC, float *res) {
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MC; m++) res[r * 4 + m] = _mm512_reduce_add_ps(acc[r][m]);
}

/* ---- fp32 and bf16 weights: any K (a masked tail) ----------------------------------------- */

INLINE AVX512 void body_float(const void *w, int bf16, i64 r0, int R, const ck_act *a, i64 m0, int MC,
                              i64 k, float *res) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < 4; m++) acc[r][m] = _mm512_setzero_ps();
    const float *x = a->x + m0 * a->ldx;
    i64 i = 0;
    for (; i + 16 <= k; i += 16) {
        __m512 xv[4];
        for (int m = 0; m < MC; m++) xv[m] = _mm512_loadu_ps(x + m * a->ldx + i);
        for (int r = 0; r < R; r++) {
            __m512 wv = bf16 ? ld_bf16((const uint16_t *)w + (r0 + r) * k + i)
                             : _mm512_loadu_ps((const float *)w + (r0 + r) * k + i);
            for (int m = 0; m < MC; m++) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
        }
    }
    if (i < k) {
        __mmask16 mk = (__mmask16)((1u << (k - i)) - 1);
        __m512 xv[4];
        for (int m = 0; m < MC; m++) xv[m] = _mm512_maskz_loadu_ps(mk, x + m * a->ldx + i);
        for (int r = 0; r < R; r++) {
            __m512 wv = bf16 ? ld_bf16_tail((const uint16_t *)w + (r0 + r) * k + i, mk)
                             : _mm512_maskz_loadu_ps(mk, (const float *)w + (r0 + r) * k + i);
            for (int m = 0; m < MC; m++) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
        }
    }
    store_res(acc, R, MC, res);
}

/* ---- q8_0: 32 int8 per group, one fp16 scale ---------------------------------------------- */

INLINE AVX512 void body_q8_0(const ck_weight *w, i64 r0, int R, const ck_act *a, i64 m0, int MC, i64 k,
                             float *res) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < 4; m++) acc[r][m] = _mm512_setzero_ps();
    const float *x = a->x + m0 * a->ldx;
    i64 groups = k / CK_GROUP;
    for (i64 g = 0; g < groups; g++) {
        __m512 xl[4], xh[4];
        for (int m = 0; m < MC; m++) {
            xl[m] = _mm512_loadu_ps(x + m * a->ldx + g * CK_GROUP);
            xh[m] = _mm512_loadu_ps(x + m * a->ldx + g * CK_GROUP + 16);
        }
        for (int r = 0; r < R; r++) {
            const int8_t *q = (const int8_t *)w->data + (r0 + r) * k + g * CK_GROUP;
            __m512 ql = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
            __m512 qh = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
            __m512 s = _mm512_set1_ps(_cvtsh_ss(((const uint16_t *)w->scales)[(r0 + r) * groups + g]));
            for (int m = 0; m < MC; m++) {
                __m512 t = _mm512_fmadd_ps(qh, xh[m], _mm512_mul_ps(ql, xl[m]));
                acc[r][m] = _mm512_fmadd_ps(t, s, acc[r][m]);
            }
        }
    }
    store_res(acc, R, MC, res);
}

/* ---- q4_1: 16 bytes per group (low nibble = even k), fp16 scale and min ------------------- */

INLINE AVX512 void body_q4_1(const ck_weight *w, i64 r0, int R, const ck_act *a, i64 m0, int MC, i64 k,
                             float *res) {
    __m512 acc[4][4];
    float mins[4][4] = {{0}};
    for (int r = 0; r < 4; r++)
        for (int m = 0; m < 4; m++) acc[r][m] = _mm512_setzero_ps();
    const float *xp = a->xperm + m0 * k;
    const float *xs = a->xsum + m0 * (k / CK_GROUP);
    i64 groups = k / CK_GROUP;
    const __m512i low = _mm512_set1_epi32(15);
    for (i64 g = 0; g < groups; g++) {
        __m512 xe[4], xo[4];
        for (int m = 0; m < MC; m++) {
            xe[m] = _mm512_loadu_ps(xp + m * k + g * CK_GROUP);
            xo[m] = _mm512_loadu_ps(xp + m * k + g * CK_GROUP + 16);
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *q = (const uint8_t *)w->data + (r0 + r) * (k / 2) + g * (CK_GROUP / 2);
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
            __m512 qe = _mm512_cvtepi32_ps(_mm512_and_si512(b, low));
            __m512 qo = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
            i64 gi = (r0 + r) * groups + g;
            __m512 s = _mm512_set1_ps(_cvtsh_ss(((const uint16_t *)w->scales)[gi]));
            float mn = _cvtsh_ss(((const uint16_t *)w->mins)[gi]);
            for (int m = 0; m < MC; m++) {
                __m512 t = _mm512_fmadd_ps(qo, xo[m], _mm512_mul_ps(qe, xe[m]));
                acc[r][m] = _mm512_fmadd_ps(t, s, acc[r][m]);
                mins[r][m] += mn * xs[m * groups + g];
            }
        }
    }
    store_res(acc, R, MC, res);
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MC; m++) res[r * 4 + m] += mins[r][m];
}

/* Constant R and MC for every call, so the compiler unrolls the tile into registers. */
#define DISPATCH(CALL)                                                                              \
    switch ((R - 1) * 4 + (MC - 1)) {                                                              \
    case 0: CALL(1, 1); break;  case 1: CALL(1, 2); break;  case 2: CALL(1, 3); break;             \
    case 3: CALL(1, 4); break;  case 4: CALL(2, 1); break;  case 5: CALL(2, 2); break;             \
    case 6: CALL(2, 3); break;  case 7: CALL(2, 4); break;  case 8: CALL(3, 1); break;             \
    case 9: CALL(3, 2); break;  case 10: CALL(3, 3); break; case 11: CALL(3, 4); break;            \
    case 12: CALL(4, 1); break; case 13: CALL(4, 2); break; case 14: CALL(4, 3); break;            \
    default: CALL(4, 4); break;                                                                     \
    }

static AVX512 void tile_f32(const ck_weight *w, i64 r0, int R, const ck_act *a, i64 m0, int MC, i64 k,
                            float *res) {
#define C(r, m) body_float((const void *)w->data, 0, r0, r, a, m0, m, k, res)
    DISPATCH(C)
#undef C
}

static AVX512 void tile_bf16(const ck_weight *w, i64 r0, int R, const ck_act *a, i64 m0, int MC, i64 k,
                             float *res) {
#define C(r, m) body_float((const void *)w->data, 1, r0, r, a, m0, m, k, res)
    DISPATCH(C)
#undef C
}

static AVX512 void tile_q8_0(const ck_weight *w, i64 r0, int R, const ck_act *a, i64 m0, int MC, i64 k,
                             float *res) {
#define C(r, m) body_q8_0(w, r0, r, a, m0, m, k, res)
    DISPATCH(C)
#undef C
}

static AVX512 void tile_q4_1(const ck_weight *w, i64 r0, int R, const ck_act *a, i64 m0, int MC, i64 k,
                             float *res) {
#define C(r, m) body_q4_1(w, r0, r, a, m0, m, k, res)
    DISPATCH(C)
#undef C
}

/* ---- attention: one query head, K/V read in place from the blocks -------------------------- */

INLINE AVX512 __m512 ld_kv(const char *kv, int bf16, i64 off) {
    return bf16 ? ld_bf16((const uint16_t *)kv + off) : _mm512_loadu_ps((const float *)kv + off);
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
        for (i64 t = 0; t < n; t++) {
            float p = expf(s[t] - nm);
            l += p;
            __m512 pv = _mm512_set1_ps(p);
            i64 off = base + a->v_offset + t * a->token_stride;
            for (int j = 0; j < nv; j++) acc[j] = _mm512_fmadd_ps(pv, ld_kv(a->kv, bf16, off + 16 * j), acc[j]);
        }
        mx = nm;
    }
    __m512 inv = _mm512_set1_ps(1.f / l);
    for (int j = 0; j < nv; j++) _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(acc[j], inv));
}

const ck_isa ck_avx512_isa = {"avx512", {tile_f32, tile_bf16, tile_q8_0, tile_q4_1}, attn};
