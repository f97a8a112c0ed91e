/* Direct placement, distribution over segments, and merging a subspace (gpu_pool/planner/packing.py:
 * place_direct, distribute, _move_window, compact_range, _evict_instead, place_subspace). */
#include "planner.h"

/* Runs of equal sizes of the tensors ts (largest first). */
idx runs_of(const Plan *p, const idx *ts, idx nts, Run *out) {
    idx r = -1;
    for (idx i = 0; i < nts; i++) {
        i64 z = p->req[ts[i]];
        if (r >= 0 && out[r].size == z) {
            out[r].count++;
        } else {
            out[++r].size = z;
            out[r].count = 1;
        }
    }
    return r + 1;
}

/* packing._best_fit: best-fit decreasing a run at a time over bins with room[b] bytes free
 * (updated). The smallest bin that holds a tensor (lowest tag on ties) takes as many of the
 * run as fit: exact best-fit, in O(bins touched) rather than O(tensors). A tag is the bin's
 * next free offset (tag_is_offset: it moves up as the bin fills) or its index. at[k] is the
 * tag tensor k (in run order) got. Returns 1, or 0 when a tensor fits no bin. */
static int best_fit(const Run *runs, idx nruns, i64 *room, i64 *tag, idx nbins, int tag_is_offset, i64 *at) {
    idx first = 0;
    for (idx r = 0; r < nruns; r++) {
        i64 size = runs[r].size, placed = 0;
        while (placed < runs[r].count) {
            idx best = -1;
            for (idx g = 0; g < nbins; g++)
                if (room[g] >= size &&
                    (best < 0 || room[g] < room[best] || (room[g] == room[best] && tag[g] < tag[best])))
                    best = g;
            if (best < 0) return 0;
            i64 k = room[best] / size;
            if (k > runs[r].count - placed) k = runs[r].count - placed;
            for (i64 t = 0; t < k; t++) at[first + placed + t] = tag[best] + (tag_is_offset ? t * size : 0);
            room[best] -= k * size;
            if (tag_is_offset) tag[best] += k * size;
            placed += k;
        }
        first += (idx)runs[r].count;
    }
    return 1;
}

/* packing.place_direct into gaps (lens, offs, ng; empty ones allowed): 1 if the tensors fit
 * without moves (their offsets written to p->place), 0 if not, ERR_NOMEM. First the whole
 * request as one block in `whole` order in the smallest gap that holds it (lowest offset on
 * ties); else best-fit decreasing over `desc` (runs `runs`). A failed attempt may leave
 * stale offsets in p->place: every tensor is placed again by whoever places it for good. */
int place_direct(Plan *p, const i64 *lens, const i64 *offs, idx ng, const idx *whole, const idx *desc,
                 idx nts, const Run *runs, idx nruns, i64 total) {
    i64 largest = 0;
    for (idx g = 0; g < ng; g++)
        if (lens[g] > largest) largest = lens[g];
    if (largest >= total) {
        idx best = -1;
        for (idx g = 0; g < ng; g++)
            if (lens[g] >= total &&
                (best < 0 || lens[g] < lens[best] || (lens[g] == lens[best] && offs[g] < offs[best])))
                best = g;
        i64 cursor = offs[best];
        for (idx k = 0; k < nts; k++) {
            p->place[whole[k]] = cursor;
            cursor += p->req[whole[k]];
        }
        return 1;
    }
    if (nruns == 0 || runs[0].size > largest) return 0;
    /* Necessary condition: tensors of >= x bytes only fit gaps of >= x bytes. */
    i64 wanted = 0;
    for (idx r = 0; r < nruns; r++) {
        i64 avail = 0;
        for (idx g = 0; g < ng; g++)
            if (lens[g] >= runs[r].size) avail += lens[g];
        wanted += runs[r].size * runs[r].count;
        if (wanted > avail) return 0;
    }
    i64 *room = malloc((size_t)(ng + nts) * 2 * sizeof(i64));
    if (!room) return ERR_NOMEM;
    i64 *tag = room + ng, *at = room + 2 * ng;
    memcpy(room, lens, (size_t)ng * sizeof(i64));
    memcpy(tag, offs, (size_t)ng * sizeof(i64));
    int fits = best_fit(runs, nruns, room, tag, ng, 1, at);
    if (fits)
        for (idx k = 0; k < nts; k++) p->place[desc[k]] = at[k];
    free(room);
    return fits;
}

/* packing.distribute: best-fit decreasing of desc over the bins' capacities (ties: lowest
 * bin). bin[k] gets the bin of desc[k]. 1 if every tensor fits, 0 if not, ERR_NOMEM. */
int distribute(const Run *runs, idx nruns, const i64 *capacity, idx nbins, i64 *bin) {
    i64 *room = malloc((size_t)(nbins + 1) * 2 * sizeof(i64));
    if (!room) return ERR_NOMEM;
    i64 *tag = room + nbins;
    memcpy(room, capacity, (size_t)nbins * sizeof(i64));
    for (idx j = 0; j < nbins; j++) tag[j] = j;
    int fits = best_fit(runs, nruns, room, tag, nbins, 0, bin);
    free(room);
    return fits;
}

/* packing._move_window: gaps lo..hi inside a..b holding need bytes whose compaction moves
 * the fewest bytes (for each right end the shortest feasible window; ties: lowest end). */
static int move_window(const Plan *p, idx a, idx b, i64 need, idx *lo, idx *hi) {
    const i64 *P = p->prefix;
    i64 *cum = malloc((size_t)(b - a + 1) * sizeof(i64)); /* cum[k]: bytes of tensors a..a+k-1 */
    if (!cum) return ERR_NOMEM;
    cum[0] = 0;
    for (idx k = 0; k < b - a; k++) cum[k + 1] = cum[k] + p->sizes[a + k];
    idx left = 0, best_j = -1, best_left = 0;
    i64 best_cost = 0;
    for (idx j = 0; j <= b - a; j++) {
        i64 ends = P[a + j + 1];
        if (ends - P[a] < need) continue;
        while (left + 1 <= b - a + 1 && P[a + left + 1] <= ends - need) left++;
        i64 cost = cum[j] - cum[left];
        if (best_j < 0 || cost < best_cost) {
            best_j = j;
            best_left = left;
            best_cost = cost;
        }
    }
    free(cum);
    if (best_j < 0) {
        PyErr_SetString(PyExc_AssertionError, "the subspace's free bytes cover its tensors");
        return ERR_SET;
    }
    *lo = a + best_left;
    *hi = a + best_j;
    return 0;
}

/* Compacting gaps lo..hi: the bytes it moves and where the free tail starts; with emit,
 * the moves are appended (address order, each to a lower address). */
static int slide(Plan *p, idx lo, idx hi, int emit, i64 *moved_bytes, i64 *tail) {
    i64 cursor = p->gap_start[lo], moved = 0;
    for (idx i = lo; i < hi; i++) {
        if (p->offsets[i] != cursor) {
            moved += p->sizes[i];
            if (emit && (vec_push(&p->moved, i) < 0 || vec_push(&p->dst, cursor) < 0)) return ERR_NOMEM;
        }
        cursor += p->sizes[i];
    }
    *moved_bytes = moved;
    *tail = cursor;
    return 0;
}

static void place_from(Plan *p, const idx *ts, idx nts, i64 cursor) {
    for (idx k = 0; k < nts; k++) {
        p->place[ts[k]] = cursor;
        cursor += p->req[ts[k]];
    }
}

/* packing.compact_range: slide the tensors of gaps a..b down, place ts in the free tail. */
int compact_range(Plan *p, idx a, idx b, const idx *ts, idx nts) {
    i64 moved, tail, need = 0;
    if (slide(p, a, b, 1, &moved, &tail) < 0) return ERR_NOMEM;
    place_from(p, ts, nts, tail);
    for (idx k = 0; k < nts; k++) need += p->req[ts[k]];
    if (tail + need > p->gap_start[b] + p->gap_len[b]) {
        PyErr_SetString(PyExc_AssertionError, "the free bytes cover the tensors");
        return ERR_SET;
    }
    return 0;
}

/* packing._evict_instead: 1 if evicting the cheapest window of the subspace costs less than
 * moving move_bytes (it is then evicted and the tensors placed there), 0 if not, <0 error. */
static int evict_instead(Plan *p, const Sub *sub, i64 need, i64 move_bytes) {
    idx cap = 2 * (sub->b - sub->a) + 1, nr = 0;
    i64 *roff = malloc((size_t)cap * 3 * sizeof(i64));
    double *price = malloc((size_t)cap * sizeof(double));
    if (!roff || !price) {
        free(roff);
        free(price);
        return ERR_NOMEM;
    }
    i64 *rlen = roff + cap, *rrow = roff + 2 * cap; /* rrow: current row, -1 for a gap */
    for (idx i = sub->a; i <= sub->b; i++) {
        if (p->gap_len[i]) {
            roff[nr] = p->gap_start[i], rlen[nr] = p->gap_len[i], rrow[nr] = -1, price[nr++] = 0.0;
        }
        if (i < sub->b) {
            roff[nr] = p->offsets[i], rlen[nr] = p->sizes[i], rrow[nr] = i;
            price[nr++] = p->prices[p->orig[i]];
        }
    }
    /* packing._cheapest_window: two pointers, the same float operations in the same order. */
    idx left = 0, ea = -1, eb = -1;
    i64 space = 0;
    double cost = 0.0, best_cost = 0.0;
    for (idx right = 0; right < nr; right++) {
        space += rlen[right];
        cost += price[right];
        while (left < right && space - rlen[left] >= need) {
            space -= rlen[left];
            cost -= price[left];
            left++;
        }
        if (space >= need && (ea < 0 || cost < best_cost)) {
            ea = left, eb = right + 1, best_cost = cost;
        }
    }
    int rc = 0;
    if (ea >= 0) {
        double seconds = 0.0;
        for (idx r = ea; r < eb; r++)
            if (rrow[r] >= 0) seconds += price[r];
        if (seconds < (double)move_bytes * p->move_cost) {
            rc = 1;
            for (idx r = ea; r < eb && rc > 0; r++) {
                if (rrow[r] < 0) continue;
                if (vec_push(&p->evicted, p->orig[rrow[r]]) < 0) rc = ERR_NOMEM;
                p->bytes_evicted += rlen[r];
            }
            if (rc > 0) {
                place_from(p, sub->ts, sub->nts, roff[ea]);
                if (roff[ea] + need > roff[eb - 1] + rlen[eb - 1]) {
                    PyErr_SetString(PyExc_AssertionError, "the evicted window covers the tensors");
                    rc = ERR_SET;
                }
            }
        }
    }
    free(roff);
    free(price);
    return rc;
}

/* packing.place_subspace for a final subspace that best-fit could not place. */
int merge_subspace(Plan *p, const Sub *sub) {
    i64 need = 0, moved, tail;
    for (idx k = 0; k < sub->nts; k++) need += p->req[sub->ts[k]];
    idx lo, hi;
    int rc = move_window(p, sub->a, sub->b, need, &lo, &hi);
    if (rc < 0) return rc;
    if (p->prices) {
        if (slide(p, lo, hi, 0, &moved, &tail) < 0) return ERR_NOMEM;
        rc = evict_instead(p, sub, need, moved);
        if (rc != 0) return rc < 0 ? rc : 0;
    }
    return compact_range(p, lo, hi, sub->ts, sub->nts);
}

