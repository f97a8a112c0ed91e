/* Partitioned-Gain Packing, Tangram Alg. 1 (gpu_pool/planner/packing.py: _after_run, _try_packing,
 * _split, partitioned_gain_packing). */
#include "planner.h"

/* packing._after_run: the halves' room after count tensors of size, each to the roomier. */
static void after_run(i64 size, i64 count, i64 *cap1, i64 *cap2) {
    i64 d = *cap1 - *cap2, k, rest;
    if (d >= 0) {
        k = d / size + 1;
        if (k > count) k = count;
        rest = count - k;
        *cap1 -= (k + rest / 2) * size;
        *cap2 -= ((rest + 1) / 2) * size;
    } else {
        k = (-d + size - 1) / size;
        if (k > count) k = count;
        rest = count - k;
        *cap1 -= ((rest + 1) / 2) * size;
        *cap2 -= (k + rest / 2) * size;
    }
}

/* packing._try_packing: can each tensor (largest first) go to the roomier half? */
static int try_packing(const Run *runs, idx nruns, i64 cap1, i64 cap2) {
    for (idx r = 0; r < nruns; r++) {
        i64 size = runs[r].size;
        if (runs[r].count > 1) after_run(size, runs[r].count - 1, &cap1, &cap2);
        if (cap1 >= cap2) {
            if (size > cap1) return 0;
            cap1 -= size;
        } else {
            if (size > cap2) return 0;
            cap2 -= size;
        }
    }
    return 1;
}

static int subs_push(SubVec *a, Sub x) {
    if (a->len == a->cap) {
        idx cap = a->cap ? 2 * a->cap : 16;
        Sub *v = realloc(a->v, (size_t)cap * sizeof(Sub));
        if (!v) return ERR_NOMEM;
        a->v = v;
        a->cap = cap;
    }
    a->v[a->len++] = x;
    return 0;
}

void subs_clear(SubVec *a) {
    for (idx i = 0; i < a->len; i++) {
        free(a->v[i].ts);
        free(a->v[i].cands);
    }
    a->len = 0;
}

/* Split sub at partition point q (TryPacking found it feasible; packing._split) and push
 * the left then the right half. */
static int push_halves(const Plan *p, SubVec *pending, const Sub *sub, idx q, i64 cap1, i64 cap2) {
    Sub left = {sub->a, q, NULL, 0, NULL, 0, 0}, right = {q + 1, sub->b, NULL, 0, NULL, 0, 0};
    left.ts = malloc((size_t)(sub->nts + 1) * sizeof(idx));
    right.ts = malloc((size_t)(sub->nts + 1) * sizeof(idx));
    left.cands = malloc((size_t)(sub->ncands + 1) * sizeof(idx));
    right.cands = malloc((size_t)(sub->ncands + 1) * sizeof(idx));
    if (!left.ts || !right.ts || !left.cands || !right.cands) goto fail;
    for (idx k = 0; k < sub->nts; k++) {
        idx t = sub->ts[k];
        if (cap1 >= cap2) {
            left.ts[left.nts++] = t;
            cap1 -= p->req[t];
        } else {
            right.ts[right.nts++] = t;
            cap2 -= p->req[t];
        }
    }
    for (idx k = 0; k < sub->ncands; k++) {
        idx c = sub->cands[k];
        if (c < q) left.cands[left.ncands++] = c;
        else if (c > q) right.cands[right.ncands++] = c;
    }
    if (subs_push(pending, left) < 0) goto fail;
    if (subs_push(pending, right) < 0) {
        pending->len--; /* left's arrays are freed below */
        goto fail;
    }
    return 0;
fail:
    free(left.ts);
    free(right.ts);
    free(left.cands);
    free(right.cands);
    return ERR_NOMEM;
}

/* packing.partitioned_gain_packing on gaps a..b for the tensors ts (largest first; taken
 * over): appends the final subspaces, in the reference's order, to final. */
int pgp(Plan *p, idx a, idx b, idx *ts, idx nts, SubVec *final) {
    SubVec pending = {NULL, 0, 0};
    Run *runs = malloc((size_t)(nts + 1) * sizeof(Run));
    Point *pts = malloc((size_t)(b - a + 1) * sizeof(Point));
    Sub top = {a, b, ts, nts, malloc((size_t)(b - a + 1) * sizeof(idx)), b - a, 0};
    int rc = ERR_NOMEM;
    if (!runs || !pts || !top.cands) {
        free(top.ts);
        free(top.cands);
        goto out;
    }
    for (idx i = a; i < b; i++) pts[i - a] = (Point){p->sizes[i], i};
    if (sort_points(pts, b - a) < 0) {
        free(top.ts);
        free(top.cands);
        goto out;
    }
    for (idx k = 0; k < b - a; k++) top.cands[k] = pts[k].i;
    if (subs_push(&pending, top) < 0) {
        free(top.ts);
        free(top.cands);
        goto out;
    }
    while (pending.len) {
        Sub sub = pending.v[--pending.len];
        if (sub.nts == 0) {
            free(sub.ts);
            free(sub.cands);
            continue;
        }
        idx nruns = runs_of(p, sub.ts, sub.nts, runs);
        i64 total = 0;
        for (idx r = 0; r < nruns; r++) total += runs[r].size * runs[r].count;
        int placed = place_direct(p, p->gap_len + sub.a, p->gap_start + sub.a, sub.b - sub.a + 1, sub.ts,
                                  sub.ts, sub.nts, runs, nruns, total);
        if (placed < 0) goto fail_sub;
        sub.direct = placed; /* splitting a directly placeable subspace gains nothing */
        if (!placed) {
            const i64 *prefix = p->prefix;
            i64 largest = runs[0].size, fa = prefix[sub.a], fb = prefix[sub.b + 1];
            int tries = 0, split = 0;
            for (idx k = 0; k < sub.ncands && !split && tries < p->max_tries; k++) {
                idx q = sub.cands[k];
                i64 fq = prefix[q + 1], cap1 = fq - fa, cap2 = fb - fq;
                i64 small = cap1 <= cap2 ? cap1 : cap2, big = cap1 <= cap2 ? cap2 : cap1;
                if (largest > small) { /* tensors larger than the smaller half need the bigger one */
                    i64 larger = 0;
                    for (idx r = 0; r < nruns && runs[r].size > small; r++) larger += runs[r].size * runs[r].count;
                    if (larger > big) continue;
                }
                if (try_packing(runs, nruns, cap1, cap2)) {
                    if (push_halves(p, &pending, &sub, q, cap1, cap2) < 0) goto fail_sub;
                    split = 1;
                } else {
                    tries++;
                }
            }
            if (split) {
                free(sub.ts);
                free(sub.cands);
                continue;
            }
        }
        free(sub.cands); /* final: merged (no partition point worked) or placed directly */
        sub.cands = NULL;
        if (subs_push(final, sub) < 0) goto fail_sub;
        continue;
    fail_sub:
        free(sub.ts);
        free(sub.cands);
        goto out;
    }
    rc = 0;
out:
    subs_clear(&pending);
    free(pending.v);
    free(runs);
    free(pts);
    return rc;
}

