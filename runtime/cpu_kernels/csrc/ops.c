/* The drivers: how work is split over OpenMP threads, and the epilogues that round results to
 * the model dtype at the points runtime/models/llama.py's torch path rounds them. */
#include <omp.h>
#include <stdlib.h>

#include "ck.h"

static inline float rnd(float v, int round) { return round ? ck_round_bf16(v) : v; }

/* ---- linear -------------------------------------------------------------------------------- */

#define TILE_ROWS 4

/* Rows [r0, r0 + R) of weight `wi` against every row of x: results in res[m][R] order. */
static void tile_all_rows(const ck_isa *isa, const ck_weight *w, i64 r0, int R, const ck_act *a, float *res) {
    float t[16];
    for (i64 m0 = 0; m0 < a->m; m0 += 4) {
        int mc = a->m - m0 < 4 ? (int)(a->m - m0) : 4;
        isa->tile[w->dtype](w, r0, R, a, m0, mc, a->k, t);
        for (int m = 0; m < mc; m++)
            for (int r = 0; r < R; r++) res[(m0 + m) * TILE_ROWS + r] = t[r * 4 + m];
    }
}

/* v (|v| <= 127) rounded to nearest, ties to even (the default rounding mode, as torch.round and
 * lrintf): adding 1.5 * 2^23 leaves no fraction bits, subtracting it back is exact. Unlike
 * lrintf, no libm call per value (GCC keeps lrintf out of line without -fno-math-errno: it
 * took ~4 ns a value, ~0.4 ms of a SmolLM2 decode step); -ffp-contract=off keeps the two adds. */
static inline int8_t round_code(float v) { return (int8_t)(int)((v + 12582912.f) - 12582912.f); }

/* x as q8 codes (CK_X_Q8): per group of 32, d = max|x| / 127 and q = x / d rounded to nearest
 * (even). A group holding a NaN or an infinity gets d = NaN and codes 0, so its products come
 * out NaN as the float path's would (a float NaN has no int8 code). A group too small for
 * 127 / max|x| to be finite (max|x| < ~4e-37) gets d = 0 and codes 0. */
static void quantize_q8(const float *x, i64 ldx, i64 m, i64 k, int8_t *q, float *d) {
    i64 groups = k / CK_GROUP;
    for (i64 r = 0; r < m; r++)
        for (i64 g = 0; g < groups; g++) {
            const float *xs = x + r * ldx + g * CK_GROUP;
            int8_t *qs = q + r * k + g * CK_GROUP;
            float amax = 0.f;
            int finite = 1;
            for (int i = 0; i < CK_GROUP; i++) {
                float v = fabsf(xs[i]);
                finite &= v <= 3.4028235e38f; /* false for NaN and infinities */
                amax = v > amax ? v : amax;
            }
            if (!finite) {
                d[r * groups + g] = NAN;
                memset(qs, 0, CK_GROUP);
                continue;
            }
            float inv = amax > 0.f ? 127.f / amax : 0.f;
            if (!(inv <= 3.4028235e38f)) amax = inv = 0.f; /* overflowed: a group of ~0 */
            d[r * groups + g] = amax / 127.f;
            for (int i = 0; i < CK_GROUP; i++) qs[i] = round_code(xs[i] * inv);
        }
}

int ck_linear(const ck_isa *isa, int nthreads, const ck_weight *w, int nw, const float *x, i64 ldx, i64 m,
              i64 k, float *out, i64 ldo, int flags, int swiglu) {
    int round = flags & CK_ROUND_BF16, accumulate = flags & CK_ACCUMULATE;
    ck_act a = {x, ldx, m, k, NULL, NULL, NULL, NULL, NULL};
    float *scratch = NULL;
    uint16_t *xbf = NULL;
    float *xd = NULL; /* CK_X_Q8: scales and codes in one block */
    int need_perm = 0, any_bf16 = 0, any_q8 = 0;
    for (int i = 0; i < nw; i++) {
        need_perm |= w[i].dtype == CK_Q4_1;
        any_bf16 |= w[i].dtype == CK_BF16;
        any_q8 |= w[i].dtype == CK_Q8_0;
    }
    if ((flags & CK_X_BF16) && any_bf16 && isa->bf16_dot) {
        xbf = malloc(sizeof(uint16_t) * (size_t)(m * k));
        if (!xbf) return -1;
        for (i64 r = 0; r < m; r++)
            for (i64 j = 0; j < k; j++) xbf[r * k + j] = ck_f32_to_bf16(x[r * ldx + j]);
        a.xbf = xbf;
    }
    if ((flags & CK_X_Q8) && any_q8 && isa->q8_dot) { /* the groups' scales, then the codes */
        i64 groups = m * (k / CK_GROUP);
        xd = malloc(sizeof(float) * (size_t)groups + (size_t)(m * k));
        if (!xd) {
            free(xbf);
            return -1;
        }
        quantize_q8(x, ldx, m, k, (int8_t *)(xd + groups), xd);
        a.xq = (const int8_t *)(xd + groups);
        a.xd = xd;
    }
    if (need_perm) { /* q4_1 reads x as evens then odds per group, and each group's sum */
        i64 groups = k / CK_GROUP;
        scratch = malloc(sizeof(float) * (size_t)(m * k + m * groups));
        if (!scratch) {
            free(xbf);
            free(xd);
            return -1;
        }
        for (i64 r = 0; r < m; r++) {
            const float *xr = x + r * ldx;
            float *p = scratch + r * k, *s = scratch + m * k + r * groups;
            for (i64 g = 0; g < groups; g++) {
                float sum = 0.f;
                for (int i = 0; i < CK_GROUP / 2; i++) {
                    p[g * CK_GROUP + i] = xr[g * CK_GROUP + 2 * i];
                    p[g * CK_GROUP + 16 + i] = xr[g * CK_GROUP + 2 * i + 1];
                }
                for (int i = 0; i < CK_GROUP; i++) sum += xr[g * CK_GROUP + i];
                s[g] = sum;
            }
        }
        a.xperm = scratch;
        a.xsum = scratch + m * k;
    }
    /* Tiles of TILE_ROWS rows, never crossing from one weight into the next (qkv: q, k, v
     * side by side in `out`); swiglu pairs gate and up rows in one tile. */
    i64 start[4] = {0}, col[4] = {0};
    int parts = swiglu ? 1 : nw;
    for (int i = 0; i < parts; i++) {
        start[i + 1] = start[i] + (w[i].n + TILE_ROWS - 1) / TILE_ROWS;
        col[i + 1] = col[i] + w[i].n;
    }
    i64 tiles = start[parts];
    int nt = nthreads < 1 ? 1 : nthreads;
    if (tiles < 2 * nt) nt = 1; /* too little work to wake a team for */
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        int tid = omp_get_thread_num(), team = omp_get_num_threads();
        float *res = malloc(sizeof(float) * (size_t)(2 * m * TILE_ROWS));
        if (!res) {
#pragma omp atomic write
            failed = 1;
        } else {
            i64 lo = tiles * tid / team, hi = tiles * (tid + 1) / team;
            for (i64 t = lo; t < hi; t++) {
                int p = 0;
                while (t >= start[p + 1]) p++;
                const ck_weight *wp = &w[p];
                i64 r0 = (t - start[p]) * TILE_ROWS;
                int R = wp->n - r0 < TILE_ROWS ? (int)(wp->n - r0) : TILE_ROWS;
                tile_all_rows(isa, wp, r0, R, &a, res);
                if (swiglu) {
                    tile_all_rows(isa, &w[1], r0, R, &a, res + m * TILE_ROWS);
                    for (i64 mi = 0; mi < m; mi++)
                        for (int r = 0; r < R; r++) {
                            float g = res[mi * TILE_ROWS + r], u = res[(m + mi) * TILE_ROWS + r];
                            if (w[0].bias) g += ck_load((const void *)w[0].bias, w[0].bias_dtype, r0 + r);
                            if (w[1].bias) u += ck_load((const void *)w[1].bias, w[1].bias_dtype, r0 + r);
                            g = rnd(g, round);
                            u = rnd(u, round);
                            float s = rnd(g / (1.f + expf(-g)), round);
                            out[mi * ldo + r0 + r] = rnd(s * u, round);
                        }
                    continue;
                }
                for (i64 mi = 0; mi < m; mi++) {
                    float *o = out + mi * ldo + col[p] + r0;
                    for (int r = 0; r < R; r++) {
                        float v = res[mi * TILE_ROWS + r];
                        if (wp->bias) v += ck_load((const void *)wp->bias, wp->bias_dtype, r0 + r);
                        v = rnd(v, round);
                        o[r] = accumulate ? rnd(o[r] + v, round) : v;
                    }
                }
            }
            free(res);
        }
    }
    free(scratch);
    free(xbf);
    free(xd);
    return failed ? -1 : 0;
}

/* ---- small per-token ops: run in the calling thread (a team costs more than they do) ------- */

void ck_rms_norm(const float *x, i64 ldx, const i64 *rows, float *out, i64 ldo, const void *w, i64 wdtype,
                 i64 n, i64 e, float eps, int round) {
    for (i64 i = 0; i < n; i++) {
        const float *xr = x + (rows ? rows[i] : i) * ldx;
        float *o = out + i * ldo;
        double ss = 0.0;
        for (i64 j = 0; j < e; j++) ss += (double)xr[j] * xr[j];
        float inv = 1.f / sqrtf((float)(ss / (double)e) + eps);
        for (i64 j = 0; j < e; j++) o[j] = rnd(rnd(xr[j] * inv, round) * ck_load(w, wdtype, j), round);
    }
}

void ck_rope(float *x, i64 ldx, i64 heads, i64 d, const i64 *pos, i64 n, const float *cos_t,
             const float *sin_t, int round) {
    i64 half = d / 2;
    for (i64 i = 0; i < n; i++) {
        const float *c = cos_t + pos[i] * half, *s = sin_t + pos[i] * half;
        for (i64 h = 0; h < heads; h++) {
            float *v = x + i * ldx + h * d;
            for (i64 j = 0; j < half; j++) {
                float cj = rnd(c[j], round), sj = rnd(s[j], round);
                float a = v[j], b = v[j + half];
                v[j] = rnd(rnd(a * cj, round) - rnd(b * sj, round), round);
                v[j + half] = rnd(rnd(b * cj, round) + rnd(a * sj, round), round);
            }
        }
    }
}

void ck_kv_write(const float *k, const float *v, i64 ld, char *kv, i64 kv_dtype, i64 block_stride, i64 bs,
                 i64 row, const i64 *slots, i64 n) {
    /* kv: kv_blocks[0, layer, 0]; V is bs * row elements after K (the next plane of the block). */
    for (i64 i = 0; i < n; i++) {
        i64 off = (slots[i] / bs) * block_stride + (slots[i] % bs) * row;
        const float *src[2] = {k + i * ld, v + i * ld};
        for (int p = 0; p < 2; p++) {
            i64 o = off + p * bs * row;
            if (kv_dtype == CK_BF16) {
                uint16_t *dst = (uint16_t *)kv + o;
                for (i64 j = 0; j < row; j++) dst[j] = ck_f32_to_bf16(src[p][j]);
            } else {
                memcpy((float *)kv + o, src[p], sizeof(float) * (size_t)row);
            }
        }
    }
}

void ck_attention(const ck_isa *isa, int nthreads, const ck_attn *a, const float *q, i64 ldq, i64 heads,
                  i64 kv_heads, const i64 *tables, i64 width, const i64 *rows, const i64 *ctx, i64 n,
                  float *out, i64 ldo, int round) {
    i64 items = n * heads, group = heads / kv_heads;
    i64 work = 0;
    for (i64 i = 0; i < n; i++) work += ctx[i];
    int nt = nthreads < 1 ? 1 : nthreads;
    if (work * heads < 512) nt = 1; /* ~30 us of work: below that a team costs more than it saves */
#pragma omp parallel for num_threads(nt) schedule(static)
    for (i64 it = 0; it < items; it++) {
        i64 i = it / heads, h = it % heads;
        float *o = out + i * ldo + h * a->d;
        isa->attn(a, q + i * ldq + h * a->d, tables + rows[i] * width, ctx[i], h / group, o);
        if (round)
            for (i64 j = 0; j < a->d; j++) o[j] = ck_round_bf16(o[j]);
    }
}

/* ---- embedding rows, any weight layout ----------------------------------------------------- */

void ck_dequant_row(const ck_weight *w, i64 row, i64 k, float *out) {
    i64 groups = k / CK_GROUP;
    switch (w->dtype) {
    case CK_F32: memcpy(out, (const float *)w->data + row * k, sizeof(float) * (size_t)k); break;
    case CK_BF16:
        for (i64 j = 0; j < k; j++) out[j] = ck_bf16_to_f32(((const uint16_t *)w->data)[row * k + j]);
        break;
    case CK_Q8_0:
        for (i64 j = 0; j < k; j++)
            out[j] = (float)((const int8_t *)w->data)[row * k + j] *
                     ck_f16_to_f32(((const uint16_t *)w->scales)[row * groups + j / CK_GROUP]);
        break;
    default:
        for (i64 j = 0; j < k; j++) {
            uint8_t b = ((const uint8_t *)w->data)[row * (k / 2) + j / 2];
            i64 g = row * groups + j / CK_GROUP;
            out[j] = (float)(j % 2 ? b >> 4 : b & 15) * ck_f16_to_f32(((const uint16_t *)w->scales)[g]) +
                     ck_f16_to_f32(((const uint16_t *)w->mins)[g]);
        }
    }
}

void ck_embedding(const ck_weight *w, const i64 *ids, i64 n, i64 e, float *out, i64 ldo) {
    for (i64 i = 0; i < n; i++) ck_dequant_row(w, ids[i], e, out + i * ldo);
}

/* ---- a whole stack of decoder layers ---------------------------------------------------------- */

int ck_decoder_layers(const ck_isa *isa, int nt, const ck_decoder *s, const ck_layer *layers, i64 nl) {
    i64 n = s->n, e = s->e, d = s->d, h = s->h, hkv = s->hkv, inter = s->inter, qkv_w = (h + 2 * hkv) * d;
    int flags = s->flags, acc = s->flags | CK_ACCUMULATE, round = s->round;
    for (i64 i = 0; i < nl; i++) {
        const ck_layer *l = &layers[i];
        char *kv = (char *)(intptr_t)l->kv;
        const void *norm1 = (const void *)(intptr_t)l->in_norm, *norm2 = (const void *)(intptr_t)l->post_norm;
        const ck_weight *qkv = (const ck_weight *)(intptr_t)l->qkv, *o = (const ck_weight *)(intptr_t)l->o;
        const ck_weight *mlp = (const ck_weight *)(intptr_t)l->mlp;
        const ck_weight *down = (const ck_weight *)(intptr_t)l->down;
        ck_attn at = {kv, s->kv_dtype, s->block_stride, s->bs * hkv * d, hkv * d, s->bs, d, s->scale};
        ck_rms_norm(s->x, e, NULL, s->hb, e, norm1, s->norm_dtype, n, e, s->eps, round);
        if (ck_linear(isa, nt, qkv, 3, s->hb, e, n, e, s->qkv, qkv_w, flags, 0)) return -1;
        ck_rope(s->qkv, qkv_w, h + hkv, d, s->pos, n, s->cos, s->sin, round);
        ck_kv_write(s->qkv + h * d, s->qkv + (h + hkv) * d, qkv_w, kv, s->kv_dtype, s->block_stride, s->bs,
                    hkv * d, s->slots, n);
        ck_attention(isa, nt, &at, s->qkv, qkv_w, h, hkv, s->tables, s->width, s->rows, s->ctx, n, s->attn,
                     h * d, round);
        if (ck_linear(isa, nt, o, 1, s->attn, h * d, n, h * d, s->x, e, acc, 0)) return -1;
        ck_rms_norm(s->x, e, NULL, s->hb, e, norm2, s->norm_dtype, n, e, s->eps, round);
        if (ck_linear(isa, nt, mlp, 2, s->hb, e, n, e, s->mlp, inter, flags, 1)) return -1;
        if (ck_linear(isa, nt, down, 1, s->mlp, inter, n, inter, s->x, e, acc, 0)) return -1;
    }
    return 0;
}
