/* Shared types of the C planner (gpu_pool._planner): see module.c for the overview.
 *
 * Layout conventions (gpu_pool/planner/layout.py): n allocated regions in address order (rows);
 * gap i (0..n) is the free space just before region i, gap n the tail up to the arena's
 * end; prefix[i] is the free bytes of gaps 0..i-1. A segment is a maximal run of movable
 * tensors between fixed regions: gaps a..b and the tensors a..b-1. Sizes are bytes (int64).
 */
#ifndef EMBER_PLANNER_H
#define EMBER_PLANNER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;
typedef Py_ssize_t idx;

#define ERR_NOMEM (-1)
#define ERR_SET (-2) /* a Python exception is set */

typedef struct {
    i64 size;
    i64 count;
} Run;

/* A growable array of int64 (rows, offsets). */
typedef struct {
    i64 *v;
    idx len, cap;
} Vec;

static inline int vec_push(Vec *a, i64 x) {
    if (a->len == a->cap) {
        idx cap = a->cap ? 2 * a->cap : 64;
        i64 *v = realloc(a->v, (size_t)cap * sizeof(i64));
        if (!v) return ERR_NOMEM;
        a->v = v;
        a->cap = cap;
    }
    a->v[a->len++] = x;
    return 0;
}

/* A stable merge sort for an array of T under a strict order LESS(&x, &y) (insertion sort
 * below 16 items). Inline comparisons: about 3x faster than qsort's callback here, and the
 * sorts (partition points, new tensors, MCE candidates) are a good part of a decision. */
#define DEFINE_SORT(NAME, T, LESS)                                                        \
    static inline void NAME##_rec(T *a, T *tmp, idx n) {                                         \
        if (n < 16) {                                                                     \
            for (idx i = 1; i < n; i++) {                                                 \
                T x = a[i];                                                               \
                idx j = i;                                                                \
                for (; j > 0 && LESS(&x, &a[j - 1]); j--) a[j] = a[j - 1];                \
                a[j] = x;                                                                 \
            }                                                                             \
            return;                                                                       \
        }                                                                                 \
        idx h = n / 2;                                                                    \
        NAME##_rec(a, tmp, h);                                                            \
        NAME##_rec(a + h, tmp, n - h);                                                    \
        if (!LESS(&a[h], &a[h - 1])) return; /* already in order */                       \
        memcpy(tmp, a, (size_t)h * sizeof(T));                                            \
        idx i = 0, j = h, k = 0;                                                          \
        while (i < h && j < n) a[k++] = LESS(&a[j], &tmp[i]) ? a[j++] : tmp[i++];         \
        while (i < h) a[k++] = tmp[i++];                                                  \
    }                                                                                     \
    static inline int NAME(T *a, idx n) {                                                        \
        T *tmp = malloc((size_t)(n / 2 + 1) * sizeof(T));                                 \
        if (!tmp) return ERR_NOMEM;                                                       \
        NAME##_rec(a, tmp, n);                                                            \
        free(tmp);                                                                        \
        return 0;                                                                         \
    }

/* A tensor (request or partition point) to order largest first, then by index. */
typedef struct {
    i64 size;
    idx i;
} Point;

#define POINT_LESS(p, q) ((p)->size != (q)->size ? (p)->size > (q)->size : (p)->i < (q)->i)
DEFINE_SORT(sort_points, Point, POINT_LESS)

/* The arena as the planner sees it after the evictions so far, and the plan being built. */
typedef struct {
    /* Current layout: n rows; orig[i] is row i's index in the caller's arrays. */
    idx n;
    i64 *offsets, *sizes, *orig, *gap_start, *gap_len, *prefix;
    char *movable;
    i64 base, end, free;
    /* The caller's arrays (n0 rows) and inputs. */
    idx n0;
    const i64 *offsets0, *sizes0;
    const char *movable0;
    char *evicted0;        /* per caller row: evicted by this plan */
    const double *prices;  /* eviction price c_j per caller row (seconds), or NULL: moves only */
    double move_cost;      /* seconds per byte moved */
    int max_tries;
    /* The new tensors in load order. */
    const i64 *req;
    idx m;
    /* Out. */
    i64 *place;   /* offset per new tensor */
    Vec moved;    /* current row of each moved tensor, in order */
    Vec dst;      /* its new offset */
    Vec evicted;  /* caller row of each evicted tensor, in order */
    i64 bytes_evicted;
} Plan;

/* A subspace of a segment: gaps a..b, its new tensors ts (largest first), its partition
 * points (movable rows, largest first); direct: best-fit placed it without moves. */
typedef struct {
    idx a, b;
    idx *ts;
    idx nts;
    idx *cands;
    idx ncands;
    int direct;
} Sub;

typedef struct {
    Sub *v;
    idx len, cap;
} SubVec;

/* placement.c: direct placement, distribution over segments, merging (Stage 2's moves) */
idx runs_of(const Plan *p, const idx *ts, idx nts, Run *out);
int place_direct(Plan *p, const i64 *lens, const i64 *offs, idx ng, const idx *whole, const idx *desc,
                 idx nts, const Run *runs, idx nruns, i64 total);
int distribute(const Run *runs, idx nruns, const i64 *capacity, idx nbins, i64 *bin);
int compact_range(Plan *p, idx a, idx b, const idx *ts, idx nts);
int merge_subspace(Plan *p, const Sub *sub);

/* pgp.c: Partitioned-Gain Packing (Alg. 1) */
int pgp(Plan *p, idx a, idx b, idx *ts, idx nts, SubVec *final);
void subs_clear(SubVec *a);

/* plan.c: the decision (direct placement, Stage 1, Stage 2) */
void rebuild(Plan *p);
int run_plan(Plan *p, PyObject *order, PyObject *keys, int global_merge);

#endif
