/* The portable path: plain C, the reference the AVX-512 and AVX2 paths are tested against, and
 * what runs on CPUs without either (or on request). Its float sums keep their order (no
 * -ffast-math), so the compiler does not vectorise them: it is several times slower. */
#include "ck.h"

static void tile_f32(const ck_weight *w, i64 r0, int R, const ck_act *a, i64 m0, int MC, i64 k, float *res) {
    for (int r = 0; r < R; r++) {
        const float *wr = (const float *)w->data + (r0 + r) * k;
        for (int m = 0; m < MC; m++) {
            const float *x = a->x + (m0 + m) * a->ldx;
            float s = 0.f;
            for (i64 i = 0; i < k; i++) s += wr[i] * x[i];
            res[r * 4 + m] = s;
        }
    }
}

static void tile_bf16(const ck_weight *w, i64 r0, int R, const ck_act *a, i64 m0, int MC, i64 k, float *res) {
    float row[512];
    for (int r = 0; r < R; r++) {
        const uint16_t *wr = (const uint16_t *)w->data + (r0 + r) * k;
        float s[4] = {0.f, 0.f, 0.f, 0.f};
        for (i64 c = 0; c < k; c += 512) { /* convert a chunk once, use it for every row of x */
            i64 n = k - c < 512 ? k - c : 512;
            for (i64 i = 0; i < n; i++) row[i] = ck_bf16_to_f32(wr[c + i]);
            for (int m = 0; m < MC; m++) {
                const float *x = a->x + (m0 + m) * a->ldx + c;
                float t = 0.f;
                for (i64 i = 0; i < n; i++) t += row[i] * x[i];
                s[m] += t;
            }
        }
        for (int m = 0; m < MC; m++) res[r * 4 + m] = s[m];
    }
}

static void tile_q8_0(const ck_weight *w, i64 r0, int R, const ck_act *a, i64 m0, int MC, i64 k, float *res) {
    i64 groups = k / CK_GROUP;
    for (int r = 0; r < R; r++) {
        const int8_t *q = (const int8_t *)w->data + (r0 + r) * k;
        const uint16_t *sc = (const uint16_t *)w->scales + (r0 + r) * groups;
        for (int m = 0; m < MC; m++) {
            const float *x = a->x + (m0 + m) * a->ldx;
            float s = 0.f;
            for (i64 g = 0; g < groups; g++) {
                float t = 0.f;
                for (int i = 0; i < CK_GROUP; i++) t += (float)q[g * CK_GROUP + i] * x[g * CK_GROUP + i];
                s += t * ck_f16_to_f32(sc[g]);
            }
            res[r * 4 + m] = s;
        }
    }
}

static void tile_q4_1(const ck_weight *w, i64 r0, int R, const ck_act *a, i64 m0, int MC, i64 k, float *res) {
    i64 groups = k / CK_GROUP;
    for (int r = 0; r < R; r++) {
        const uint8_t *q = (const uint8_t *)w->data + (r0 + r) * (k / 2);
        const uint16_t *sc = (const uint16_t *)w->scales + (r0 + r) * groups;
        const uint16_t *mn = (const uint16_t *)w->mins + (r0 + r) * groups;
        for (int m = 0; m < MC; m++) {
            const float *x = a->x + (m0 + m) * a->ldx;
            const float *xs = a->xsum + (m0 + m) * groups;
            float s = 0.f;
            for (i64 g = 0; g < groups; g++) {
                float t = 0.f;
                for (int i = 0; i < CK_GROUP / 2; i++) {
                    uint8_t b = q[g * (CK_GROUP / 2) + i];
                    t += (float)(b & 15) * x[g * CK_GROUP + 2 * i] + (float)(b >> 4) * x[g * CK_GROUP + 2 * i + 1];
                }
                s += t * ck_f16_to_f32(sc[g]) + ck_f16_to_f32(mn[g]) * xs[g];
            }
            res[r * 4 + m] = s;
        }
    }
}

static void attn(const ck_attn *a, const float *q, const i64 *table, i64 ctx, i64 kv_head, float *out) {
    float acc[512], s[512];
    i64 d = a->d, bs = a->bs;
    for (i64 i = 0; i < d; i++) acc[i] = 0.f;
    float mx = -INFINITY, l = 0.f;
    i64 esize = a->kv_dtype == CK_BF16 ? 2 : 4;
    for (i64 j0 = 0; j0 < ctx; j0 += bs) {
        i64 n = ctx - j0 < bs ? ctx - j0 : bs;
        i64 base = table[j0 / bs] * a->block_stride + kv_head * d;
        float bm = -INFINITY;
        for (i64 t = 0; t < n; t++) {
            i64 off = base + t * a->token_stride;
            float dot = 0.f;
            for (i64 i = 0; i < d; i++) dot += q[i] * ck_load(a->kv, a->kv_dtype, off + i);
            s[t] = dot * a->scale;
            if (s[t] > bm) bm = s[t];
        }
        float nm = bm > mx ? bm : mx;
        float c = expf(mx - nm); /* exp(-inf) = 0 on the first block */
        l *= c;
        for (i64 i = 0; i < d; i++) acc[i] *= c;
        for (i64 t = 0; t < n; t++) {
            float p = expf(s[t] - nm);
            l += p;
            const char *v = a->kv + (base + a->v_offset + t * a->token_stride) * esize;
            for (i64 i = 0; i < d; i++) acc[i] += p * ck_load(v, a->kv_dtype, i);
        }
        mx = nm;
    }
    for (i64 i = 0; i < d; i++) out[i] = acc[i] / l;
}

const ck_isa ck_generic_isa = {"generic", {tile_f32, tile_bf16, tile_q8_0, tile_q4_1}, attn, 0, 0};
