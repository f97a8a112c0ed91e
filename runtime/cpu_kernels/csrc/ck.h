/* Shared types of Ember's CPU decode kernels (module runtime._cpu_kernels).
 *
 * Layout conventions (the same as runtime/models/llama.py):
 *   weights   row-major (out_features N, in_features K), as stored in the pool;
 *   activations fp32 (rows, K) with an explicit row stride; outputs fp32;
 *   KV cache  (num_blocks, L, 2, BS, H_kv, D) in bf16 or fp32, blocks `block_stride` elements
 *             apart (the pool may pad a block), the rest contiguous; slot = block * BS + offset.
 * Quantized weights (groups of 32 along K):
 *   q8_0  int8 (N, K) + fp16 scales (N, K/32):               w = q * s
 *   q4_1  uint8 (N, K/2), low nibble = even k, + fp16 scales and mins (N, K/32): w = q * s + m
 */
#ifndef EMBER_CK_H
#define EMBER_CK_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef int64_t i64;

enum ck_dtype { CK_F32 = 0, CK_BF16 = 1, CK_Q8_0 = 2, CK_Q4_1 = 3, CK_F16 = 4 };
#define CK_GROUP 32

/* One weight matrix as the Python side describes it: 8 int64 per matrix. */
typedef struct {
    i64 dtype;     /* enum ck_dtype: F32, BF16, Q8_0 or Q4_1 */
    i64 data;      /* address of the (N, K) values (q4_1: (N, K/2) bytes) */
    i64 scales;    /* q8_0/q4_1: fp16 (N, K/32) */
    i64 mins;      /* q4_1: fp16 (N, K/32) */
    i64 bias;      /* 0 or the address of N values of bias_dtype */
    i64 bias_dtype;
    i64 n;         /* out_features */
    i64 reserved;
} ck_weight;

/* The activations of one linear call, with what quantized layouts precompute from them. */
typedef struct {
    const float *x; /* (M, K), row stride ldx */
    i64 ldx, m, k;
    const float *xperm; /* q4_1: x with every group of 32 reordered evens then odds, (M, K) */
    const float *xsum;  /* q4_1: sum of x per group, (M, K/32) */
    const uint16_t *xbf; /* bf16 weights on the AVX-512 path: x as bf16 (M, K) when it is exact */
    const int8_t *xq;    /* q8_0 weights with CK_X_Q8 on a path with integer dots: x as int8 (M, K) */
    const float *xd;     /* ... and each group's scale, (M, K/32): x ~= xq * xd */
} ck_act;

/* Results of one tile: res[r * 4 + m] = dot(W row r0 + r, x row m0 + m), r < R <= 4, m < MC <= 4. */
typedef void (*ck_tile_fn)(const ck_weight *w, i64 r0, int R, const ck_act *a, i64 m0, int MC, i64 k,
                           float *res);

/* One attention head for one query token: online softmax over its context, fp32 accumulate. */
typedef struct {
    const char *kv; /* address of kv_blocks[0, layer, 0, 0, 0, 0] */
    i64 kv_dtype;   /* CK_F32 or CK_BF16 */
    i64 block_stride, v_offset, token_stride; /* elements: between blocks, K to V, tokens */
    i64 bs, d;
    float scale;
} ck_attn;

typedef void (*ck_attn_fn)(const ck_attn *a, const float *q, const i64 *table, i64 ctx, i64 kv_head,
                           float *out);

typedef struct {
    const char *name;
    ck_tile_fn tile[4]; /* by dtype: F32, BF16, Q8_0, Q4_1 */
    ck_attn_fn attn;
    int bf16_dot; /* its bf16 tile reads ck_act.xbf (CK_X_BF16) */
    int q8_dot;   /* its q8_0 tile reads ck_act.xq (CK_X_Q8) */
} ck_isa;

extern const ck_isa ck_generic_isa;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CK_HAVE_X86_PATHS 1 /* compiled per function (__attribute__((target))), chosen at import */
#define CK_HAVE_AVX512_PATH 1
extern const ck_isa ck_avx512_isa;
extern const ck_isa ck_avx2_isa;
#endif

/* ---- the tile shape of the vector paths ---------------------------------------------------- */

/* A tile calls ROW(mc) once per weight row with a constant mc (1..4 rows of x), so the compiler
 * keeps that row's accumulators in registers; ROW writes float t[mc]. ATTR: the path's target. */
#define CK_DISPATCH(CALL)   \
    switch (MC) {           \
    case 1: CALL(1); break; \
    case 2: CALL(2); break; \
    case 3: CALL(3); break; \
    default: CALL(4); break; \
    }

#define CK_TILE(ATTR, NAME, ROW)                                                                      \
    static ATTR void NAME(const ck_weight *w, i64 r0, int R, const ck_act *a, i64 m0, int MC, i64 k, \
                          float *res) {                                                               \
        float t[4];                                                                                   \
        for (int r = 0; r < R; r++) {                                                                 \
            CK_DISPATCH(ROW)                                                                          \
            for (int m = 0; m < MC; m++) res[r * 4 + m] = t[m];                                       \
        }                                                                                             \
    }

/* ---- scalar conversions ------------------------------------------------------------------ */

static inline float ck_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 cast does (NaN stays NaN). */
static inline uint16_t ck_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float ck_round_bf16(float f) { return ck_bf16_to_f32(ck_f32_to_bf16(f)); }

static inline float ck_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: renormalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float ck_load(const void *p, i64 dtype, i64 i) {
    switch (dtype) {
    case CK_BF16: return ck_bf16_to_f32(((const uint16_t *)p)[i]);
    case CK_F16: return ck_f16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

/* ---- drivers (ops.c): argument checks are the binding's job ------------------------------- */

/* CK_X_BF16: every x value is a bfloat16 (a bf16 model's activations are rounded to it), so bf16
 * weights may use bf16 dot products (vdpbf16ps: exact products, fp32 sums) at half the FMAs.
 * CK_X_Q8: q8_0 weights may meet x quantized the same way, int8 per group of 32 with an fp32
 * scale (what llama.cpp's Q8_0 dot product does): exact integer dot products per group at about
 * half the instructions of widening every weight to fp32. Each x value moves by at most half a
 * step (max|x of its group| / 254); a row's codes do not depend on the other rows. */
enum { CK_ACCUMULATE = 1, CK_ROUND_BF16 = 2, CK_X_BF16 = 4, CK_X_Q8 = 8 };

int ck_linear(const ck_isa *isa, int nthreads, const ck_weight *w, int nw, const float *x, i64 ldx,
              i64 m, i64 k, float *out, i64 ldo, int flags, int swiglu);
void ck_rms_norm(const float *x, i64 ldx, const i64 *rows, float *out, i64 ldo, const void *w, i64 wdtype,
                 i64 n, i64 e, float eps, int round);
void ck_rope(float *x, i64 ldx, i64 heads, i64 d, const i64 *pos, i64 n, const float *cos_t,
             const float *sin_t, int round);
void ck_kv_write(const float *k, const float *v, i64 ld, char *kv, i64 kv_dtype, i64 block_stride, i64 bs,
                 i64 row, const i64 *slots, i64 n);
void ck_attention(const ck_isa *isa, int nthreads, const ck_attn *a, const float *q, i64 ldq, i64 heads,
                  i64 kv_heads, const i64 *tables, i64 width, const i64 *rows, const i64 *ctx, i64 n,
                  float *out, i64 ldo, int round);
void ck_embedding(const ck_weight *w, const i64 *ids, i64 n, i64 e, float *out, i64 ldo);

/* One decoder layer as ck_decoder_layers reads it (int64 rows of 7): the addresses of its input
 * norm weight, its q|k|v descriptors (3), o (1), post-attention norm weight, gate|up (2), down (1)
 * and of its KV cache (kv_blocks[0, layer, 0]). */
typedef struct {
    i64 in_norm, qkv, o, post_norm, mlp, down, kv;
} ck_layer;

/* A step's rows and the buffers they run through (runtime/models/llama_decode.py's scratch). */
typedef struct {
    i64 n, e, h, hkv, d, inter; /* rows; hidden; heads; KV heads; head dim; intermediate */
    float *x, *hb, *qkv, *attn, *mlp;
    const i64 *pos, *slots, *tables, *rows, *ctx;
    i64 width; /* of the block tables */
    const float *cos, *sin;
    i64 norm_dtype, kv_dtype, block_stride, bs;
    float eps, scale;
    int flags, round;
} ck_decoder;

/* Every layer in one call: the nine kernels of a layer in llama_decode.py's order, with the same
 * arguments (equal results); -1 when out of memory. */
int ck_decoder_layers(const ck_isa *isa, int nthreads, const ck_decoder *s, const ck_layer *layers, i64 nl);
void ck_dequant_row(const ck_weight *w, i64 row, i64 k, float *out);

#endif
