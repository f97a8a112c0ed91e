/* The decision: direct placement, Stage 1 eviction rounds, Stage 2 per segment
 * (gpu_pool/planner/allocator.py: plan, take_victims; gpu_pool/planner/layout.py: segments). */
#include "planner.h"

/* Recompute the current layout from the caller's rows minus the evicted ones. */
void rebuild(Plan *p) {
    idx n = 0;
    for (idx r = 0; r < p->n0; r++) {
        if (p->evicted0[r]) continue;
        p->offsets[n] = p->offsets0[r], p->sizes[n] = p->sizes0[r];
        p->movable[n] = p->movable0[r], p->orig[n] = r;
        n++;
    }
    p->n = n;
    i64 cursor = p->base, free = 0;
    for (idx i = 0; i <= n; i++) {
        i64 next = i < n ? p->offsets[i] : p->end;
        p->gap_start[i] = cursor;
        p->gap_len[i] = next - cursor;
        p->prefix[i] = free;
        free += next - cursor;
        if (i < n) cursor = p->offsets[i] + p->sizes[i];
    }
    p->prefix[n + 1] = free;
    p->free = free;
}

/* Stage 1 (allocator.plan's take_victims): evict the next tensors of the order (at least
 * one) until free >= min_free. Returns 1 if it evicted some and free >= min_free, 0 if
 * not, <0 on error. *next is the position in the order, shared by every round. */
static int take_victims(Plan *p, PyObject *order, idx *next, PyObject **rows, PyObject *keys, i64 min_free) {
    if (!*rows) { /* key -> caller row of every movable tensor; built when first needed */
        *rows = PyDict_New();
        if (!*rows) return ERR_SET;
        for (idx r = 0; r < p->n0; r++) {
            if (!p->movable0[r]) continue;
            PyObject *row = PyLong_FromSsize_t(r);
            if (!row || PyDict_SetItem(*rows, PyList_GET_ITEM(keys, r), row) < 0) {
                Py_XDECREF(row);
                return ERR_SET;
            }
            Py_DECREF(row);
        }
    }
    idx norder = PySequence_Fast_GET_SIZE(order), taken = 0;
    i64 free = p->free;
    while (*next < norder) {
        PyObject *row = PyDict_GetItemWithError(*rows, PySequence_Fast_GET_ITEM(order, *next));
        (*next)++;
        if (!row) {
            if (PyErr_Occurred()) return ERR_SET;
            continue; /* not a movable tensor of this arena */
        }
        idx r = PyLong_AsSsize_t(row);
        if (p->evicted0[r]) continue; /* listed twice */
        p->evicted0[r] = 1;
        if (vec_push(&p->evicted, r) < 0) return ERR_NOMEM;
        taken++;
        free += p->sizes0[r];
        p->bytes_evicted += p->sizes0[r];
        if (free >= min_free) break;
    }
    if (taken) rebuild(p);
    return taken && free >= min_free;
}

/* allocator.plan. Returns 1 planned, 0 out of memory, <0 error. */
int run_plan(Plan *p, PyObject *order, PyObject *keys, int global_merge) {
    idx m = p->m;
    idx *load = malloc((size_t)(m + 1) * sizeof(idx)), *desc = malloc((size_t)(m + 1) * sizeof(idx));
    idx *seg_first = NULL, *seg_last = NULL;
    i64 *bin = malloc((size_t)(m + 1) * sizeof(i64));
    i64 *seg_free = NULL;
    Run *runs = malloc((size_t)(m + 1) * sizeof(Run));
    Point *pts = malloc((size_t)(m + 1) * sizeof(Point));
    PyObject *rows = NULL;
    SubVec final = {NULL, 0, 0};
    int rc = ERR_NOMEM;
    idx next = 0, nseg = 0;
    if (!load || !desc || !bin || !runs || !pts) goto out;
    i64 need = 0;
    for (idx k = 0; k < m; k++) {
        load[k] = k;
        pts[k] = (Point){p->req[k], k};
        need += p->req[k];
    }
    if (sort_points(pts, m) < 0) goto out; /* ties keep load order */
    for (idx k = 0; k < m; k++) desc[k] = pts[k].i;
    idx nruns = runs_of(p, desc, m, runs);
    seg_first = malloc((size_t)(p->n0 + 2) * sizeof(idx));
    seg_last = malloc((size_t)(p->n0 + 2) * sizeof(idx));
    seg_free = malloc((size_t)(p->n0 + 2) * sizeof(i64));
    if (!seg_first || !seg_last || !seg_free) goto out;
    for (;;) { /* direct placement, after each round of Stage 1 evictions */
        int placed = place_direct(p, p->gap_len, p->gap_start, p->n + 1, load, desc, m, runs, nruns, need);
        if (placed) {
            rc = placed < 0 ? placed : 1;
            goto out;
        }
        int got;
        if (p->free < need) {
            if ((got = take_victims(p, order, &next, &rows, keys, need)) <= 0) {
                rc = got;
                goto out;
            }
            continue;
        }
        /* Segments: runs of movable tensors between fixed rows (layout.segments). */
        nseg = 0;
        idx first = 0;
        for (idx i = 0; i <= p->n; i++) {
            if (i < p->n && p->movable[i]) continue;
            seg_first[nseg] = first, seg_last[nseg] = i;
            seg_free[nseg] = p->prefix[i + 1] - p->prefix[first];
            nseg++;
            first = i + 1;
        }
        int fits = distribute(runs, nruns, seg_free, nseg, bin);
        if (fits < 0) goto out;
        if (fits) break;
        if ((got = take_victims(p, order, &next, &rows, keys, 0)) <= 0) {
            rc = got;
            goto out;
        }
    }
    /* Stage 2, segments in address order; each gets its tensors largest first. */
    for (idx j = 0; j < nseg; j++) {
        idx nts = 0;
        idx *ts = malloc((size_t)(m + 1) * sizeof(idx));
        if (!ts) goto out;
        for (idx k = 0; k < m; k++)
            if (bin[k] == j) ts[nts++] = desc[k];
        idx a = seg_first[j], b = seg_last[j];
        if (global_merge) {
            int r = (b > a || nts) ? compact_range(p, a, b, ts, nts) : 0;
            free(ts);
            if (r < 0) {
                rc = r;
                goto out;
            }
            continue;
        }
        if (!nts) {
            free(ts);
            continue;
        }
        int r = pgp(p, a, b, ts, nts, &final); /* takes ts */
        for (idx i = 0; r == 0 && i < final.len; i++)
            if (!final.v[i].direct) r = merge_subspace(p, &final.v[i]);
        subs_clear(&final);
        if (r < 0) {
            rc = r;
            goto out;
        }
    }
    rc = 1;
out:
    subs_clear(&final);
    free(final.v);
    Py_XDECREF(rows);
    free(load);
    free(desc);
    free(bin);
    free(runs);
    free(pts);
    free(seg_first);
    free(seg_last);
    free(seg_free);
    return rc;
}

