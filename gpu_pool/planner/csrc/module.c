/* The Tangram planner's decision in C (module gpu_pool._planner): direct placement, Stage 1
 * eviction, Stage 2 packing, and MCE's sort.
 *
 * The readable reference is Python: gpu_pool/planner/allocator.py (direct placement, Stage 1) and
 * gpu_pool/planner/packing.py (distribution over segments, PGP, best-fit, move windows, Eq. 1's
 * evict-or-merge). These files make the same decisions in the same order; property tests
 * (tests/gpu_pool/test_planner_engines.py) check that both engines return identical plans.
 * They exist for speed: a decision over ~1,500 regions visits dozens of subspaces and
 * hundreds of partition points, about 1 ms of Python work and tens of microseconds here.
 *
 *   module.c     the Python binding (argument checks, results as Python objects), MCE sort
 *   plan.c       the decision: direct placement, Stage 1 rounds, Stage 2 per segment
 *   pgp.c        Partitioned-Gain Packing (Alg. 1)
 *   placement.c  best-fit placement, distribution over segments, merging a subspace
 *   planner.h    shared types and the layout conventions
 *
 * The GIL is held throughout: the Reuse Store plans under its lock anyway.
 */
#include "planner.h"

/* ---- Python binding --------------------------------------------------------------------- */

static int get_column(PyObject *obj, Py_buffer *view, const char *name, idx len, char kind) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    idx itemsize = kind == '?' ? 1 : 8;
    int ok = view->itemsize == itemsize && f[0] != '\0' && f[1] == '\0' &&
             (kind == 'd' ? f[0] == 'd' : kind == '?' ? f[0] == '?' : (f[0] == 'q' || f[0] == 'l'));
    if (!ok || view->len / itemsize != len) {
        PyErr_Format(PyExc_ValueError, "%s must be a contiguous %s array of %zd items", name,
                     kind == 'd' ? "float64" : kind == '?' ? "bool" : "int64", len);
        PyBuffer_Release(view);
        view->obj = NULL;
        return -1;
    }
    return 0;
}

/* A `move_type` (tuple subclass) instance (key, src, dst, size); NULL on error. */
static PyObject *new_move(PyTypeObject *type, PyObject *key, i64 src, i64 dst, i64 size) {
    PyObject *mv = type->tp_alloc(type, 4);
    if (!mv) return NULL;
    Py_INCREF(key);
    PyTuple_SET_ITEM(mv, 0, key);
    PyObject *a = PyLong_FromLongLong(src), *b = PyLong_FromLongLong(dst), *c = PyLong_FromLongLong(size);
    PyTuple_SET_ITEM(mv, 1, a); /* set before checking: a NULL slot is fine for dealloc */
    PyTuple_SET_ITEM(mv, 2, b);
    PyTuple_SET_ITEM(mv, 3, c);
    if (!a || !b || !c) {
        Py_DECREF(mv);
        return NULL;
    }
    return mv;
}

PyDoc_STRVAR(plan_doc,
"plan(offsets, sizes, movable, keys, base, end, request_sizes, eviction_order, prices,\n"
"     move_type, global_merge, move_seconds_per_byte, max_split_tries)\n"
"--\n\n"
"The decision of gpu_pool.planner.allocator.plan on the allocated regions of an arena [base, end):\n"
"offsets/sizes (int64 arrays, address order), movable (bool array: inactive tensors),\n"
"keys (list). request_sizes: the new tensors in load order; eviction_order: keys, cheapest\n"
"first; prices: float64 eviction price per region or None (moves only); move_type: the\n"
"tuple subclass moves are built as (key, src, dst, size). Returns (offsets per new tensor,\n"
"or None when the request does not fit; evicted keys; moves; bytes evicted; free bytes).");

static PyObject *py_plan(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_off, *o_size, *o_mov, *keys, *o_req, *o_order, *o_price, *move_type;
    long long base, end;
    int global_merge, max_tries;
    double move_cost;
    if (!PyArg_ParseTuple(args, "OOOO!LLOOOO!pdi:plan", &o_off, &o_size, &o_mov, &PyList_Type, &keys, &base,
                          &end, &o_req, &o_order, &o_price, &PyType_Type, &move_type, &global_merge,
                          &move_cost, &max_tries))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)move_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "move_type must be a tuple subclass");
        return NULL;
    }
    if (max_tries < 1 || !(move_cost >= 0) || end < base) {
        PyErr_SetString(PyExc_ValueError, "need max_split_tries >= 1, move_seconds_per_byte >= 0, end >= base");
        return NULL;
    }
    idx n0 = PyList_GET_SIZE(keys);
    Py_buffer views[4];
    memset(views, 0, sizeof(views));
    PyObject *result = NULL, *req_seq = NULL, *order = NULL, *places = NULL, *moves = NULL, *evicted = NULL;
    Plan p;
    memset(&p, 0, sizeof(p));
    i64 *req = NULL;
    if (get_column(o_off, &views[0], "offsets", n0, 'q') < 0 || get_column(o_size, &views[1], "sizes", n0, 'q') < 0 ||
        get_column(o_mov, &views[2], "movable", n0, '?') < 0 ||
        (o_price != Py_None && get_column(o_price, &views[3], "prices", n0, 'd') < 0))
        goto done;
    p.n0 = n0, p.offsets0 = views[0].buf, p.sizes0 = views[1].buf, p.movable0 = views[2].buf;
    p.prices = o_price != Py_None ? views[3].buf : NULL;
    p.base = base, p.end = end, p.move_cost = move_cost, p.max_tries = max_tries;
    i64 cursor = base; /* the rows must tile inside [base, end) without overlaps */
    for (idx r = 0; r < n0; r++) {
        if (p.offsets0[r] < cursor || p.sizes0[r] <= 0) {
            PyErr_Format(PyExc_ValueError, "region %zd overlaps its predecessor or is empty", r);
            goto done;
        }
        cursor = p.offsets0[r] + p.sizes0[r];
    }
    if (cursor > end) {
        PyErr_SetString(PyExc_ValueError, "the regions leave the arena");
        goto done;
    }
    if (!(req_seq = PySequence_Fast(o_req, "request_sizes must be a sequence of ints"))) goto done;
    if (!(order = PySequence_Fast(o_order, "eviction_order must be a sequence of keys"))) goto done;
    p.m = PySequence_Fast_GET_SIZE(req_seq);
    size_t rows = (size_t)n0 + 2;
    req = malloc((size_t)(p.m + 1) * 2 * sizeof(i64));
    p.offsets = malloc(rows * 6 * sizeof(i64));
    p.movable = malloc(rows);
    p.evicted0 = calloc(rows, 1);
    if (!req || !p.offsets || !p.movable || !p.evicted0) {
        PyErr_NoMemory();
        goto done;
    }
    p.sizes = p.offsets + rows, p.orig = p.offsets + 2 * rows, p.gap_start = p.offsets + 3 * rows;
    p.gap_len = p.offsets + 4 * rows, p.prefix = p.offsets + 5 * rows;
    p.req = req, p.place = req + p.m + 1;
    for (idx k = 0; k < p.m; k++) {
        req[k] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(req_seq, k));
        if (req[k] == -1 && PyErr_Occurred()) goto done;
        if (req[k] <= 0) {
            PyErr_SetString(PyExc_ValueError, "request sizes must be > 0");
            goto done;
        }
    }
    rebuild(&p);
    int rc = p.m ? run_plan(&p, order, keys, global_merge) : 1;
    if (rc < 0) {
        if (rc == ERR_NOMEM) PyErr_NoMemory();
        goto done;
    }
    if (rc == 1) {
        if (!(places = PyList_New(p.m))) goto done;
        for (idx k = 0; k < p.m; k++) {
            PyObject *v = PyLong_FromLongLong(p.place[k]);
            if (!v) goto done;
            PyList_SET_ITEM(places, k, v);
        }
    } else {
        places = Py_NewRef(Py_None);
    }
    if (!(moves = PyList_New(p.moved.len)) || !(evicted = PyList_New(p.evicted.len))) goto done;
    for (idx k = 0; k < p.moved.len; k++) {
        idx i = (idx)p.moved.v[k];
        PyObject *mv = new_move((PyTypeObject *)move_type, PyList_GET_ITEM(keys, p.orig[i]), p.offsets[i],
                                p.dst.v[k], p.sizes[i]);
        if (!mv) goto done;
        PyList_SET_ITEM(moves, k, mv);
    }
    for (idx k = 0; k < p.evicted.len; k++) {
        PyObject *key = PyList_GET_ITEM(keys, (idx)p.evicted.v[k]);
        Py_INCREF(key);
        PyList_SET_ITEM(evicted, k, key);
    }
    result = Py_BuildValue("OOOLL", places, evicted, moves, (long long)p.bytes_evicted, (long long)p.free);
done:
    for (int v = 0; v < 4; v++)
        if (views[v].obj) PyBuffer_Release(&views[v]);
    Py_XDECREF(req_seq);
    Py_XDECREF(order);
    Py_XDECREF(places);
    Py_XDECREF(moves);
    Py_XDECREF(evicted);
    free(req);
    free(p.offsets);
    free(p.movable);
    free(p.evicted0);
    free(p.moved.v);
    free(p.dst.v);
    free(p.evicted.v);
    return result;
}

/* ---- Stage 1's MCE order ---------------------------------------------------------------- */

typedef struct {
    double rate, last_used;
    i64 size;
    idx i;
} Candidate;

/* rate, then least recently used, then largest, then input order */
#define CANDIDATE_LESS(p, q)                                                                    \
    ((p)->rate != (q)->rate             ? (p)->rate < (q)->rate                                 \
     : (p)->last_used != (q)->last_used ? (p)->last_used < (q)->last_used                       \
     : (p)->size != (q)->size           ? (p)->size > (q)->size                                 \
                                        : (p)->i < (q)->i)
DEFINE_SORT(sort_candidates, Candidate, CANDIDATE_LESS)

PyDoc_STRVAR(mce_order_doc,
"mce_order(keys, per_byte_rates, last_used, sizes)\n"
"--\n\n"
"keys ordered by per-byte rate, then last use (oldest first), then size (largest first),\n"
"then input order: gpu_pool.planner.eviction.mce_ranking's sort (numpy.lexsort of the same keys).");

static PyObject *py_mce_order(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o_keys, *o_rate, *o_last, *o_size, *seq[4] = {NULL, NULL, NULL, NULL}, *out = NULL;
    if (!PyArg_ParseTuple(args, "OOOO:mce_order", &o_keys, &o_rate, &o_last, &o_size)) return NULL;
    PyObject *objs[4] = {o_keys, o_rate, o_last, o_size};
    for (int k = 0; k < 4; k++)
        if (!(seq[k] = PySequence_Fast(objs[k], "mce_order takes four sequences"))) goto done;
    idx n = PySequence_Fast_GET_SIZE(seq[0]);
    for (int k = 1; k < 4; k++)
        if (PySequence_Fast_GET_SIZE(seq[k]) != n) {
            PyErr_SetString(PyExc_ValueError, "mce_order: the sequences differ in length");
            goto done;
        }
    Candidate *c = malloc((size_t)(n + 1) * sizeof(Candidate));
    if (!c) {
        PyErr_NoMemory();
        goto done;
    }
    for (idx i = 0; i < n; i++) {
        c[i].rate = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq[1], i));
        c[i].last_used = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq[2], i));
        c[i].size = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq[3], i));
        c[i].i = i;
        if (PyErr_Occurred()) break;
        if (c[i].rate != c[i].rate || c[i].last_used != c[i].last_used) {
            PyErr_SetString(PyExc_ValueError, "mce_order: rates and last-use times must not be NaN");
            break;
        }
    }
    if (!PyErr_Occurred() && sort_candidates(c, n) < 0) PyErr_NoMemory();
    if (!PyErr_Occurred()) {
        if ((out = PyList_New(n)))
            for (idx i = 0; i < n; i++) {
                PyObject *key = PySequence_Fast_GET_ITEM(seq[0], c[i].i);
                Py_INCREF(key);
                PyList_SET_ITEM(out, i, key);
            }
    }
    free(c);
done:
    for (int k = 0; k < 4; k++) Py_XDECREF(seq[k]);
    return out;
}

static PyMethodDef methods[] = {
    {"plan", py_plan, METH_VARARGS, plan_doc},
    {"mce_order", py_mce_order, METH_VARARGS, mce_order_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gpu_pool._planner",
    "The Tangram planner's decision in C; the reference is gpu_pool/planner/allocator.py and packing.py.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__planner(void) { return PyModule_Create(&module); }
