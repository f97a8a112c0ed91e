/* Python binding of Ember's CPU decode kernels (module runtime._cpu_kernels).
 *
 *   module.c   this file: argument parsing (METH_FASTCALL, integers are addresses and sizes),
 *              ISA choice, GIL release around compute
 *   ops.c      drivers: the OpenMP split and the epilogues (rounding to the model dtype)
 *   generic.c  the portable tiles and attention (the reference, and CPUs without AVX2)
 *   avx512.c   the same with AVX-512 intrinsics under __attribute__((target))
 *   avx2.c     the same with AVX2/FMA intrinsics, for x86-64 CPUs without the AVX-512 path
 *   ck.h       shared types and layout conventions
 *
 * Addresses come from torch's tensor.data_ptr(); the Python wrapper
 * (runtime/cpu_kernels/ops.py) checks shapes and dtypes, this file checks sizes and codes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "ck.h"

typedef struct {
    const ck_isa *isa; /* the path every call takes: chosen at import, forced by set_isa */
} module_state;

static module_state *state_of(PyObject *module) { return (module_state *)PyModule_GetState(module); }

typedef union {
    i64 i;
    double f;
} arg;

/* Parse `n` positional arguments by `fmt`: 'i' int64, 'f' float. */
static int parse(const char *name, PyObject *const *args, Py_ssize_t nargs, const char *fmt, arg *out) {
    Py_ssize_t want = (Py_ssize_t)strlen(fmt);
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        if (fmt[i] == 'f') {
            out[i].f = PyFloat_AsDouble(args[i]);
            if (out[i].f == -1.0 && PyErr_Occurred()) return -1;
        } else {
            out[i].i = PyLong_AsLongLong(args[i]);
            if (out[i].i == -1 && PyErr_Occurred()) return -1;
        }
    }
    return 0;
}

static int bad(const char *msg) {
    PyErr_SetString(PyExc_ValueError, msg);
    return -1;
}

static int check_weights(const ck_weight *w, int nw, i64 k) {
    for (int i = 0; i < nw; i++) {
        if (w[i].dtype < CK_F32 || w[i].dtype > CK_Q4_1) return bad("weight dtype code must be 0..3");
        if (!w[i].data || w[i].n < 1) return bad("weight address and out_features must be set");
        if ((w[i].dtype == CK_Q8_0 || w[i].dtype == CK_Q4_1) && (k % CK_GROUP || !w[i].scales))
            return bad("quantized weights need in_features % 32 == 0 and scales");
        if (w[i].dtype == CK_Q4_1 && !w[i].mins) return bad("q4_1 weights need mins");
        if (w[i].bias && w[i].bias_dtype != CK_F32 && w[i].bias_dtype != CK_BF16 && w[i].bias_dtype != CK_F16)
            return bad("bias dtype code must be 0, 1 or 4");
    }
    return 0;
}

PyDoc_STRVAR(linear_doc,
"linear(nthreads, weights, nweights, x, ldx, m, k, out, ldo, flags, swiglu)\n--\n\n"
"out[:, cols of weight i] = x @ W_i.T (+ bias) for the `nweights` matrices described at `weights`\n"
"(int64 (nweights, 8): dtype, data, scales, mins, bias, bias_dtype, out_features, 0), side by side\n"
"in `out`. x: fp32 (m, k), row stride ldx; out: fp32, row stride ldo. flags: 1 accumulate\n"
"(out += result), 2 round to bfloat16 where the torch path does, 4 every x is a bfloat16 value\n"
"(bf16 weights may then use bf16 dot products), 8 q8_0 weights may meet x quantized to int8\n"
"per group of 32 (integer dot products where the path has them). swiglu=1 (two weights, gate\n"
"and up): out = silu(x @ Wg.T) * (x @ Wu.T).");

static PyObject *py_linear(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg a[11];
    if (parse("linear", args, nargs, "iiiiiiiiiii", a) < 0) return NULL;
    int nw = (int)a[2].i;
    i64 m = a[5].i, k = a[6].i;
    const ck_weight *w = (const ck_weight *)(intptr_t)a[1].i;
    if (nw < 1 || nw > 3 || !w || m < 1 || k < 1 || !a[3].i || !a[7].i || a[4].i < k) {
        bad("linear: 1..3 weights, m >= 1, k >= 1, ldx >= k and addresses are required");
        return NULL;
    }
    if (a[10].i && (nw != 2 || w[0].n != w[1].n)) {
        bad("linear: swiglu takes two weights of one shape");
        return NULL;
    }
    i64 cols = 0;
    for (int i = 0; i < nw; i++) cols += w[i].n;
    if (check_weights(w, nw, k) < 0) return NULL;
    if (a[8].i < (a[10].i ? w[0].n : cols)) {
        bad("linear: ldo is smaller than the output row");
        return NULL;
    }
    const ck_isa *isa = state_of(self)->isa;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ck_linear(isa, (int)a[0].i, w, nw, (const float *)(intptr_t)a[3].i, a[4].i, m, k,
                   (float *)(intptr_t)a[7].i, a[8].i, (int)a[9].i, (int)a[10].i);
    Py_END_ALLOW_THREADS
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(rms_norm_doc,
"rms_norm(x, ldx, rows, out, ldo, weight, weight_dtype, n, e, eps, round)\n--\n\n"
"out[i] = rms_norm(x[rows[i]]) * weight for i < n (rows = 0: row i), fp32 rows of e values.");

static PyObject *py_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    arg a[11];
    if (parse("rms_norm", args, nargs, "iiiiiiiiifi", a) < 0) return NULL;
    if (!a[0].i || !a[3].i || !a[5].i || a[7].i < 1 || a[8].i < 1 || a[1].i < a[8].i || a[4].i < a[8].i ||
        (a[6].i != CK_F32 && a[6].i != CK_BF16 && a[6].i != CK_F16)) {
        bad("rms_norm: addresses, n >= 1, e >= 1, strides >= e and a float weight dtype are required");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    ck_rms_norm((const float *)(intptr_t)a[0].i, a[1].i, (const i64 *)(intptr_t)a[2].i,
                (float *)(intptr_t)a[3].i, a[4].i, (const void *)(intptr_t)a[5].i, a[6].i, a[7].i, a[8].i,
                (float)a[9].f, (int)a[10].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(rope_doc,
"rope(x, ldx, heads, d, positions, n, cos, sin, round)\n--\n\n"
"Rotate `heads` heads of d values in each of n fp32 rows in place (rotate-half, as HF Llama),\n"
"with cos/sin fp32 tables (max_position, d/2) indexed by the int64 positions.");

static PyObject *py_rope(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    arg a[9];
    if (parse("rope", args, nargs, "iiiiiiiii", a) < 0) return NULL;
    if (!a[0].i || !a[4].i || !a[6].i || !a[7].i || a[2].i < 1 || a[3].i < 2 || a[3].i % 2 || a[5].i < 1 ||
        a[1].i < a[2].i * a[3].i) {
        bad("rope: addresses, heads >= 1, an even d and ldx >= heads * d are required");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    ck_rope((float *)(intptr_t)a[0].i, a[1].i, a[2].i, a[3].i, (const i64 *)(intptr_t)a[4].i, a[5].i,
            (const float *)(intptr_t)a[6].i, (const float *)(intptr_t)a[7].i, (int)a[8].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(kv_write_doc,
"kv_write(k, v, ld, kv, kv_dtype, block_stride, block_size, row, slots, n)\n--\n\n"
"Store n rows of `row` fp32 values of k and v (row stride ld) at their int64 slots in the cache:\n"
"kv is the address of kv_blocks[0, layer, 0], block_stride in elements, kv_dtype 0 fp32, 1 bf16.");

static PyObject *py_kv_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    arg a[10];
    if (parse("kv_write", args, nargs, "iiiiiiiiii", a) < 0) return NULL;
    if (!a[0].i || !a[1].i || !a[3].i || !a[8].i || (a[4].i != CK_F32 && a[4].i != CK_BF16) || a[6].i < 1 ||
        a[7].i < 1 || a[2].i < a[7].i || a[9].i < 1 || a[5].i < 2 * a[6].i * a[7].i) {
        bad("kv_write: addresses, a float KV dtype, n >= 1 and consistent sizes are required");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    ck_kv_write((const float *)(intptr_t)a[0].i, (const float *)(intptr_t)a[1].i, a[2].i,
                (char *)(intptr_t)a[3].i, a[4].i, a[5].i, a[6].i, a[7].i, (const i64 *)(intptr_t)a[8].i, a[9].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(attention_doc,
"paged_decode_attention(nthreads, q, ldq, kv, kv_dtype, block_stride, block_size, heads, kv_heads, d,\n"
"                       tables, width, rows, ctx, n, out, ldo, scale, round)\n--\n\n"
"For each of n query rows (heads * d fp32, stride ldq): attention over the first ctx[i] tokens\n"
"of the sequence whose block table is row rows[i] of `tables` (int64 (B, width)), K/V read in\n"
"place (kv: the address of kv_blocks[0, layer, 0]); out: fp32 (n, heads * d), stride ldo.");

static PyObject *py_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg a[19];
    if (parse("paged_decode_attention", args, nargs, "iiiiiiiiiiiiiiiiifi", a) < 0) return NULL;
    i64 bs = a[6].i, heads = a[7].i, kvh = a[8].i, d = a[9].i, n = a[14].i;
    if (!a[1].i || !a[3].i || !a[10].i || !a[12].i || !a[13].i || !a[15].i ||
        (a[4].i != CK_F32 && a[4].i != CK_BF16) || bs < 1 || bs > 512 || d < 1 || d > 512 || kvh < 1 ||
        heads < kvh || heads % kvh || n < 1 || a[2].i < heads * d || a[16].i < heads * d ||
        a[5].i < 2 * bs * kvh * d || a[11].i < 1) {
        bad("paged_decode_attention: addresses, a float KV dtype, 1 <= block_size, d <= 512, heads a "
            "multiple of kv_heads and consistent strides are required");
        return NULL;
    }
    const i64 *ctx = (const i64 *)(intptr_t)a[13].i;
    for (i64 i = 0; i < n; i++)
        if (ctx[i] < 1 || ctx[i] > a[11].i * bs) {
            bad("paged_decode_attention: every context must have 1 <= ctx <= width * block_size tokens");
            return NULL;
        }
    ck_attn at = {(const char *)(intptr_t)a[3].i, a[4].i, a[5].i, bs * kvh * d, kvh * d, bs, d, (float)a[17].f};
    const ck_isa *isa = state_of(self)->isa;
    Py_BEGIN_ALLOW_THREADS
    ck_attention(isa, (int)a[0].i, &at, (const float *)(intptr_t)a[1].i, a[2].i, heads, kvh,
                 (const i64 *)(intptr_t)a[10].i, a[11].i, (const i64 *)(intptr_t)a[12].i, ctx, n,
                 (float *)(intptr_t)a[15].i, a[16].i, (int)a[18].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(embedding_doc,
"embedding(weight, ids, n, e, out, ldo)\n--\n\n"
"out[i] = row ids[i] of the weight described at `weight` (int64 (8,)), as fp32.");

static PyObject *py_embedding(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    arg a[6];
    if (parse("embedding", args, nargs, "iiiiii", a) < 0) return NULL;
    const ck_weight *w = (const ck_weight *)(intptr_t)a[0].i;
    if (!w || !a[1].i || !a[4].i || a[2].i < 1 || a[3].i < 1 || a[5].i < a[3].i) {
        bad("embedding: addresses, n >= 1, e >= 1 and ldo >= e are required");
        return NULL;
    }
    if (check_weights(w, 1, a[3].i) < 0) return NULL;
    const i64 *ids = (const i64 *)(intptr_t)a[1].i;
    for (i64 i = 0; i < a[2].i; i++)
        if (ids[i] < 0 || ids[i] >= w->n) {
            bad("embedding: token id out of range");
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    ck_embedding(w, ids, a[2].i, a[3].i, (float *)(intptr_t)a[4].i, a[5].i);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(decoder_layers_doc,
"decoder_layers(nthreads, layers, nlayers, n, e, heads, kv_heads, d, inter, x, h, qkv, attn, mlp,\n"
"               positions, slots, tables, width, rows, ctx, cos, sin, norm_dtype, kv_dtype,\n"
"               block_stride, block_size, eps, scale, flags, round)\n--\n\n"
"Run `nlayers` decoder layers over n rows in one call: per layer what rms_norm, linear (q|k|v),\n"
"rope, kv_write, paged_decode_attention, linear (o, accumulate), rms_norm, linear (swiglu) and\n"
"linear (down, accumulate) do with the same arguments. `layers`: int64 (nlayers, 7) rows of\n"
"input-norm weight, q|k|v descriptors, o, post-norm weight, gate|up, down, KV address\n"
"(kv_blocks[0, layer, 0]); x, h, qkv, attn, mlp: fp32 scratch of (n, e), (n, e),\n"
"(n, (heads + 2 kv_heads) d), (n, heads d), (n, inter); flags as linear's (accumulate is added).");

static int check_layer(const ck_layer *l, i64 e, i64 qkv_w, i64 hd, i64 inter) {
    const ck_weight *qkv = (const ck_weight *)(intptr_t)l->qkv, *o = (const ck_weight *)(intptr_t)l->o;
    const ck_weight *mlp = (const ck_weight *)(intptr_t)l->mlp, *down = (const ck_weight *)(intptr_t)l->down;
    if (!l->in_norm || !l->post_norm || !l->kv || !qkv || !o || !mlp || !down)
        return bad("decoder_layers: every layer needs its norm weights, descriptors and KV address");
    if (check_weights(qkv, 3, e) < 0 || check_weights(o, 1, hd) < 0 || check_weights(mlp, 2, e) < 0 ||
        check_weights(down, 1, inter) < 0)
        return -1;
    if (qkv[0].n + qkv[1].n + qkv[2].n != qkv_w || o->n != e || mlp[0].n != inter || mlp[1].n != inter ||
        down->n != e)
        return bad("decoder_layers: a layer's weights do not have the model's shapes");
    return 0;
}

static PyObject *py_decoder_layers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    arg a[30];
    if (parse("decoder_layers", args, nargs, "iiiiiiiiiiiiiiiiiiiiiiiiiiffii", a) < 0) return NULL;
    const ck_layer *layers = (const ck_layer *)(intptr_t)a[1].i;
    i64 nl = a[2].i, n = a[3].i, e = a[4].i, h = a[5].i, hkv = a[6].i, d = a[7].i, inter = a[8].i;
    i64 width = a[17].i, bs = a[25].i;
    int addresses = 1; /* arguments 9..21: scratch, step and RoPE tables (17 is width, a count) */
    for (int i = 9; i <= 21; i++) addresses &= i == 17 || a[i].i != 0;
    if (!layers || nl < 1 || n < 1 || e < 1 || hkv < 1 || h < hkv || h % hkv || d < 2 || d % 2 || d > 512 ||
        inter < 1 || !addresses || width < 1 || bs < 1 || bs > 512 ||
        (a[22].i != CK_F32 && a[22].i != CK_BF16 && a[22].i != CK_F16) ||
        (a[23].i != CK_F32 && a[23].i != CK_BF16) || a[24].i < 2 * bs * hkv * d) {
        bad("decoder_layers: addresses, positive sizes, heads a multiple of kv_heads, an even d <= 512, "
            "1 <= block_size <= 512, float dtypes and a consistent block stride are required");
        return NULL;
    }
    const i64 *ctx = (const i64 *)(intptr_t)a[19].i;
    for (i64 i = 0; i < n; i++)
        if (ctx[i] < 1 || ctx[i] > width * bs) {
            bad("decoder_layers: every context must have 1 <= ctx <= width * block_size tokens");
            return NULL;
        }
    for (i64 i = 0; i < nl; i++)
        if (check_layer(&layers[i], e, (h + 2 * hkv) * d, h * d, inter) < 0) return NULL;
    ck_decoder s = {
        n, e, h, hkv, d, inter,
        (float *)(intptr_t)a[9].i, (float *)(intptr_t)a[10].i, (float *)(intptr_t)a[11].i,
        (float *)(intptr_t)a[12].i, (float *)(intptr_t)a[13].i,
        (const i64 *)(intptr_t)a[14].i, (const i64 *)(intptr_t)a[15].i, (const i64 *)(intptr_t)a[16].i,
        (const i64 *)(intptr_t)a[18].i, ctx, width,
        (const float *)(intptr_t)a[20].i, (const float *)(intptr_t)a[21].i,
        a[22].i, a[23].i, a[24].i, bs, (float)a[26].f, (float)a[27].f, (int)a[28].i, (int)a[29].i,
    };
    const ck_isa *isa = state_of(self)->isa;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = ck_decoder_layers(isa, (int)a[0].i, &s, layers, nl);
    Py_END_ALLOW_THREADS
    if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static int cpu_has_avx512(void) {
#ifdef CK_HAVE_X86_PATHS
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

static int cpu_has_avx2(void) {
#ifdef CK_HAVE_X86_PATHS
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

static const ck_isa *best_isa(void) {
#ifdef CK_HAVE_X86_PATHS
    if (cpu_has_avx512()) return &ck_avx512_isa;
    if (cpu_has_avx2()) return &ck_avx2_isa;
#endif
    return &ck_generic_isa;
}

PyDoc_STRVAR(isa_doc, "isa()\n--\n\nThe path the kernels take: 'avx512', 'avx2' or 'generic'.");

static PyObject *py_isa(PyObject *self, PyObject *unused) {
    (void)unused;
    return PyUnicode_FromString(state_of(self)->isa->name);
}

PyDoc_STRVAR(q8_dot_doc,
"q8_dot()\n--\n\nWhether the path's q8_0 products take x as int8 codes under flag 8 (integer dots).");

static PyObject *py_q8_dot(PyObject *self, PyObject *unused) {
    (void)unused;
    return PyBool_FromLong(state_of(self)->isa->q8_dot);
}

PyDoc_STRVAR(set_isa_doc,
"set_isa(name)\n--\n\nForce 'generic', 'avx2' or 'avx512' (ValueError when this CPU lacks it); 'auto': the best.");

static PyObject *py_set_isa(PyObject *self, PyObject *name) {
    const char *s = PyUnicode_AsUTF8(name);
    if (!s) return NULL;
    if (!strcmp(s, "generic")) {
        state_of(self)->isa = &ck_generic_isa;
    } else if (!strcmp(s, "auto")) {
        state_of(self)->isa = best_isa();
#ifdef CK_HAVE_X86_PATHS
    } else if (!strcmp(s, "avx512") && cpu_has_avx512()) {
        state_of(self)->isa = &ck_avx512_isa;
    } else if (!strcmp(s, "avx2") && cpu_has_avx2()) {
        state_of(self)->isa = &ck_avx2_isa;
#endif
    } else if (!strcmp(s, "avx512")) {
        bad("this CPU lacks AVX-512 F/BW/VL/DQ/BF16");
        return NULL;
    } else if (!strcmp(s, "avx2")) {
        bad("this CPU lacks AVX2 with FMA and F16C");
        return NULL;
    } else {
        bad("isa must be 'generic', 'avx2', 'avx512' or 'auto'");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"linear", (PyCFunction)(void (*)(void))py_linear, METH_FASTCALL, linear_doc},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL, rms_norm_doc},
    {"rope", (PyCFunction)(void (*)(void))py_rope, METH_FASTCALL, rope_doc},
    {"kv_write", (PyCFunction)(void (*)(void))py_kv_write, METH_FASTCALL, kv_write_doc},
    {"paged_decode_attention", (PyCFunction)(void (*)(void))py_attention, METH_FASTCALL, attention_doc},
    {"embedding", (PyCFunction)(void (*)(void))py_embedding, METH_FASTCALL, embedding_doc},
    {"decoder_layers", (PyCFunction)(void (*)(void))py_decoder_layers, METH_FASTCALL, decoder_layers_doc},
    {"isa", py_isa, METH_NOARGS, isa_doc},
    {"q8_dot", py_q8_dot, METH_NOARGS, q8_dot_doc},
    {"set_isa", py_set_isa, METH_O, set_isa_doc},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject *module) {
    state_of(module)->isa = best_isa();
    return 0;
}

static PyModuleDef_Slot slots[] = {{Py_mod_exec, (void *)exec_module}, {0, NULL}};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "runtime._cpu_kernels", "Ember's CPU decode kernels (see runtime/cpu_kernels).",
    sizeof(module_state), methods, slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cpu_kernels(void) { return PyModuleDef_Init(&moduledef); }
