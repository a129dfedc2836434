/* Radix select of many ranks at once: a histogram of the top 16 key bits,
 * a gather of the keys in the wanted buckets, then a small select on those. */
#include "select.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../lib/codec/codec_impl.h"
#include "../../lib/parallel.h"
#include "../quantize_common.h"

#define NB 65536                  /* buckets of the top 16 key bits */
#define SUB_MAX ((size_t)1 << 30) /* values per histogram: counts fit 32 bits */
#define SMALL_N 4096              /* below this, sort the keys */

static void *grow(void *p, size_t *cap, size_t need)
{
    if (*cap >= need && p)
        return p;
    free(p);
    *cap = 0;
    p = malloc(need ? need : 1);
    if (p)
        *cap = need;
    return p;
}

void epipe_sq_select_free(sq_select *s)
{
    free(s->hist);
    free(s->cand);
    free(s->aux);
    memset(s, 0, sizeof *s);
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

static int cmp_u16(const void *a, const void *b)
{
    return (int)*(const uint16_t *)a - (int)*(const uint16_t *)b;
}

static void select_small(const float *x, size_t n, const uint64_t *rank, size_t R, float *val,
                         uint64_t *lt)
{
    uint32_t keys[SMALL_N];
    for (size_t i = 0; i < n; i++)
        keys[i] = sq_key(x[i]);
    qsort(keys, n, sizeof *keys, cmp_u32);
    for (size_t i = 0; i < R; i++) {
        uint32_t k = keys[rank[i]];
        size_t first = rank[i];
        while (first > 0 && keys[first - 1] == k)
            first--;
        val[i] = sq_unkey(k);
        lt[i] = first;
    }
}

/* Order keys of x[0..n) into keys[] (n <= KB); *bad becomes NaN if some x
 * is NaN or infinite. */
#define KB 1024
EPIPE_CLONES static void keys_block(const float *x, size_t n, uint32_t *keys, float *bad)
{
    const vf zero = vsplat(0.0f);
    vf acc = zero;
    size_t i = 0;
    for (; i + VL <= n; i += VL) {
        vf v;
        memcpy(&v, x + i, sizeof v);
        acc += v * zero;
        vi u = (vi)(v + zero);
        vi k = u ^ ((u >> 31) | vsplati(INT32_MIN));
        memcpy(keys + i, &k, sizeof k);
    }
    for (; i < n; i++) {
        acc[0] += x[i] * 0.0f;
        keys[i] = sq_key(x[i]);
    }
    for (unsigned e = 0; e < VL; e++)
        *bad += acc[e];
}

/* Wanted buckets as at most MAX_RANGES runs of keys, in signed order. */
#define MAX_RANGES 16
/* Keys so frequent (a run of ties, the zeros after a ReLU) that they are
 * counted in the gather pass rather than copied as candidates. */
#define MAX_HEAVY 4
#define PROBES 4096

struct sel_ctx {
    const float *x;
    size_t n;
    unsigned nsub, nslots, nranges, nheavy;
    uint32_t *hist;      /* [nsub][NB] */
    float *bad;          /* [nsub] */
    const int32_t *slot; /* [NB]: slot of a wanted bucket, else -1 */
    uint64_t *off;       /* [nsub][nslots]: next write position in cand */
    uint64_t *heq;       /* [nsub][MAX_HEAVY]: values equal to each heavy key */
    uint16_t *cand;
    int32_t rlo[MAX_RANGES], rhi[MAX_RANGES];
    int32_t heavy[MAX_HEAVY]; /* heavy keys, in signed order */
};

static void hist_task(void *p, unsigned task, unsigned ntasks)
{
    struct sel_ctx *c = p;
    uint32_t keys[KB];
    for (unsigned s = task; s < c->nsub; s += ntasks) {
        uint32_t *h = c->hist + (size_t)s * NB;
        memset(h, 0, sizeof(uint32_t) * NB);
        size_t b, e;
        float bad = 0.0f;
        epipe_split_range(c->n, c->nsub, s, 64, &b, &e);
        for (size_t i = b; i < e; i += KB) {
            size_t cnt = e - i < KB ? e - i : KB;
            keys_block(c->x + i, cnt, keys, &bad);
            for (size_t k = 0; k < cnt; k++)
                h[keys[k] >> 16]++;
        }
        c->bad[s] = bad;
    }
}

/* One value of the gather: count it if heavy, else append it to its slot. */
static inline void gather_one(const struct sel_ctx *c, uint32_t k, uint64_t *off, uint64_t *heq)
{
    int32_t sl = c->slot[k >> 16];
    if (sl < 0)
        return;
    for (unsigned h = 0; h < c->nheavy; h++)
        if ((int32_t)(k ^ 0x80000000u) == c->heavy[h]) {
            heq[h]++;
            return;
        }
    c->cand[off[sl]++] = (uint16_t)k;
}

/* Appends the low key halves of x[0..n) that fall in wanted buckets: a
 * vector range test first, the bucket table only for hits. */
EPIPE_CLONES static void gather_block(const float *x, size_t n, const struct sel_ctx *c,
                                      uint64_t *off, uint64_t *heq)
{
    vi lo[MAX_RANGES], hi[MAX_RANGES], hv[MAX_HEAVY], eq[MAX_HEAVY];
    for (unsigned r = 0; r < c->nranges; r++) {
        lo[r] = vsplati(c->rlo[r]);
        hi[r] = vsplati(c->rhi[r]);
    }
    for (unsigned h = 0; h < c->nheavy; h++) {
        hv[h] = vsplati(c->heavy[h]);
        eq[h] = vsplati(0);
    }
    const vf zero = vsplat(0.0f);
    size_t i = 0;
    for (; i + VL <= n; i += VL) {
        vf v;
        memcpy(&v, x + i, sizeof v);
        vi u = (vi)(v + zero);
        vi sk = u ^ ((u >> 31) & vsplati(INT32_MAX)); /* key ^ 0x80000000 */
        vi any = vsplati(0);
        for (unsigned r = 0; r < c->nranges; r++)
            any |= (sk >= lo[r]) & (sk <= hi[r]);
        for (unsigned h = 0; h < c->nheavy; h++) {
            vi e = sk == hv[h];
            eq[h] -= e;
            any &= ~e;
        }
        uint64_t w[4];
        memcpy(w, &any, sizeof w);
        if (!(w[0] | w[1] | w[2] | w[3]))
            continue;
        for (unsigned e = 0; e < VL; e++)
            if (any[e])
                c->cand[off[c->slot[((uint32_t)sk[e] ^ 0x80000000u) >> 16]]++] = (uint16_t)sk[e];
    }
    for (unsigned h = 0; h < c->nheavy; h++)
        for (unsigned e = 0; e < VL; e++)
            heq[h] += (uint32_t)eq[h][e];
    for (; i < n; i++)
        gather_one(c, sq_key(x[i]), off, heq);
}

static void gather_task(void *p, unsigned task, unsigned ntasks)
{
    struct sel_ctx *c = p;
    for (unsigned s = task; s < c->nsub; s += ntasks) {
        uint64_t *off = c->off + (size_t)s * c->nslots, *heq = c->heq + (size_t)s * MAX_HEAVY;
        size_t b, e;
        epipe_split_range(c->n, c->nsub, s, 64, &b, &e);
        memset(heq, 0, sizeof *heq * MAX_HEAVY);
        if (c->nranges) {
            for (size_t i = b; i < e; i += KB * 64)
                gather_block(c->x + i, e - i < KB * 64 ? e - i : KB * 64, c, off, heq);
            continue;
        }
        for (size_t i = b; i < e; i++) /* many wanted buckets: the table alone */
            gather_one(c, sq_key(c->x[i]), off, heq);
    }
}

/* A key holding a quarter or more of the values of a big bucket, found by
 * probing PROBES evenly spaced values; 0 with *key unset if there is none.
 * It only saves time: results are the same either way. */
static int find_heavy(const float *x, size_t n, uint32_t bucket, uint32_t *key)
{
    uint16_t lows[PROBES];
    unsigned nl = 0;
    for (size_t p = 0; p < PROBES; p++) {
        uint32_t k = sq_key(x[(uint64_t)p * n / PROBES]);
        if (k >> 16 == bucket)
            lows[nl++] = (uint16_t)k;
    }
    if (nl < 64)
        return 0;
    qsort(lows, nl, sizeof *lows, cmp_u16);
    unsigned best = 0, bestn = 0;
    for (unsigned i = 0, j; i < nl; i = j) { /* the longest run */
        for (j = i + 1; j < nl && lows[j] == lows[i];)
            j++;
        if (j - i > bestn)
            best = lows[i], bestn = j - i;
    }
    if (bestn * 4 < nl)
        return 0;
    *key = bucket << 16 | best;
    return 1;
}

/* A slot's candidates plus its heavy keys' counts, as a histogram input. */
struct extra {
    uint16_t lo;
    uint64_t cnt;
};

/* The value below which `rr` of the slot's values lie, by two 8-bit rounds;
 * *below gets how many of them are smaller than it. */
static uint16_t select_two_rounds(const uint16_t *cand, uint64_t c, const struct extra *ex,
                                  unsigned nex, uint64_t rr, uint64_t *below)
{
    uint64_t h[256] = {0}, cum = 0;
    unsigned hb = 0, lb = 0;
    for (uint64_t i = 0; i < c; i++)
        h[cand[i] >> 8]++;
    for (unsigned e = 0; e < nex; e++)
        h[ex[e].lo >> 8] += ex[e].cnt;
    while (cum + h[hb] <= rr)
        cum += h[hb++];
    memset(h, 0, sizeof h);
    for (uint64_t i = 0; i < c; i++)
        if ((unsigned)(cand[i] >> 8) == hb)
            h[cand[i] & 255u]++;
    for (unsigned e = 0; e < nex; e++)
        if ((unsigned)(ex[e].lo >> 8) == hb)
            h[ex[e].lo & 255u] += ex[e].cnt;
    while (cum + h[lb] <= rr)
        cum += h[lb++];
    *below = cum;
    return (uint16_t)(hb << 8 | lb);
}

int epipe_sq_select_ranks(sq_select *s, const float *x, size_t n, const uint64_t *rank, size_t R,
                          float *val, uint64_t *lt, unsigned threads, int *nonfinite)
{
    if (nonfinite)
        *nonfinite = 0;
    if (R == 0 || n == 0)
        return 0;
    if (n <= SMALL_N) {
        if (nonfinite && epipe_find_nonfinite(x, n) < n) {
            *nonfinite = 1;
            return 0;
        }
        select_small(x, n, rank, R, val, lt);
        return 0;
    }
    if (threads < 1)
        threads = 1;
    unsigned nsub = (unsigned)((n + SUB_MAX - 1) / SUB_MAX);
    if (nsub < threads)
        nsub = threads;
    uint32_t *hist = s->hist = grow(s->hist, &s->hist_cap, sizeof(uint32_t) * NB * nsub);
    /* aux: tot[NB] u64, slot[NB] i32; per rank its slot and the count below
     * its bucket; per slot bucket, base, count and heavy count; off and
     * off0 [nsub][slots]; heq [nsub][MAX_HEAVY]; bad [nsub]. */
    size_t aux_need = NB * 12 + R * 48 + (size_t)nsub * R * 16 + (size_t)nsub * MAX_HEAVY * 8 +
                      (size_t)nsub * 4;
    uint8_t *aux = s->aux = grow(s->aux, &s->aux_cap, aux_need);
    if (!hist || !aux)
        return EPIPE_ENOMEM;
    uint64_t *tot = (uint64_t *)aux;
    int32_t *slot = (int32_t *)(tot + NB);
    uint64_t *below = (uint64_t *)(slot + NB);
    uint64_t *rslot = below + R;
    uint64_t *sbucket = rslot + R, *sbase = sbucket + R, *scount = sbase + R;
    uint64_t *sheavy = scount + R; /* heavy key index + 1 of a slot, or 0 */
    uint64_t *off = sheavy + R, *off0 = off + (size_t)nsub * R;
    uint64_t *heq = off0 + (size_t)nsub * R;
    float *bad = (float *)(heq + (size_t)nsub * MAX_HEAVY);

    struct sel_ctx c = {.x = x,
                        .n = n,
                        .nsub = nsub,
                        .hist = hist,
                        .bad = bad,
                        .slot = slot,
                        .off = off,
                        .heq = heq};
    epipe_parallel_run(threads, hist_task, &c);
    if (nonfinite) {
        for (unsigned sub = 0; sub < nsub; sub++)
            *nonfinite |= isnan(bad[sub]);
        if (*nonfinite)
            return 0;
    }
    memset(tot, 0, sizeof(uint64_t) * NB);
    for (unsigned sub = 0; sub < nsub; sub++)
        for (size_t b = 0; b < NB; b++)
            tot[b] += hist[(size_t)sub * NB + b];

    /* Find each rank's bucket; consecutive ranks in one bucket share a slot. */
    uint64_t cum = 0;
    size_t b = 0;
    unsigned nslots = 0;
    memset(slot, 0xff, sizeof(int32_t) * NB);
    for (size_t i = 0; i < R; i++) {
        while (cum + tot[b] <= rank[i])
            cum += tot[b++];
        if (slot[b] < 0) {
            slot[b] = (int32_t)nslots;
            sbucket[nslots] = b;
            scount[nslots] = tot[b];
            sheavy[nslots] = 0;
            nslots++;
        }
        rslot[i] = (uint64_t)slot[b];
        below[i] = cum;
    }
    for (unsigned d = 0; d < nslots && c.nheavy < MAX_HEAVY; d++) {
        uint32_t key;
        if (scount[d] >= 65536 && scount[d] >= n / 64 &&
            find_heavy(x, n, (uint32_t)sbucket[d], &key)) {
            c.heavy[c.nheavy++] = (int32_t)(key ^ 0x80000000u);
            sheavy[d] = c.nheavy;
        }
    }
    uint64_t ncand = 0;
    for (unsigned d = 0; d < nslots; d++) {
        sbase[d] = ncand;
        ncand += scount[d];
    }
    /* Sub-range s writes a slot's values after those of the ranges before. */
    for (unsigned d = 0; d < nslots; d++) {
        uint64_t o = sbase[d];
        for (unsigned sub = 0; sub < nsub; sub++) {
            off0[(size_t)sub * nslots + d] = off[(size_t)sub * nslots + d] = o;
            o += hist[(size_t)sub * NB + sbucket[d]];
        }
    }
    uint16_t *cand = s->cand = grow(s->cand, &s->cand_cap, sizeof(uint16_t) * ncand);
    if (!cand)
        return EPIPE_ENOMEM;
    c.cand = cand;
    c.nslots = nslots;
    /* Slots are in bucket order: merge adjacent buckets into key ranges. */
    for (unsigned d = 0; d < nslots && c.nranges <= MAX_RANGES; d++) {
        int32_t lo = (int32_t)((uint32_t)(sbucket[d] << 16) ^ 0x80000000u), hi = lo | 0xffff;
        if (c.nranges && c.rhi[c.nranges - 1] + 1 == lo)
            c.rhi[c.nranges - 1] = hi;
        else if (c.nranges < MAX_RANGES)
            c.rlo[c.nranges] = lo, c.rhi[c.nranges++] = hi;
        else
            c.nranges = MAX_RANGES + 1;
    }
    if (c.nranges > MAX_RANGES)
        c.nranges = 0;
    epipe_parallel_run(threads, gather_task, &c);
    /* Close the gaps heavy keys left: each slot's values become contiguous. */
    for (unsigned d = 0; d < nslots; d++) {
        uint64_t w = sbase[d];
        for (unsigned sub = 0; sub < nsub; sub++) {
            uint64_t a = off0[(size_t)sub * nslots + d], e = off[(size_t)sub * nslots + d];
            if (a != w)
                memmove(cand + w, cand + a, sizeof *cand * (e - a));
            w += e - a;
        }
        scount[d] = w - sbase[d];
    }

    /* Within each slot: one 16-bit histogram for all its ranks, or two 8-bit
     * rounds per rank when that is cheaper. hist[0..NB) is free again. */
    uint32_t *h = hist;
    memset(h, 0, sizeof(uint32_t) * NB);
    for (size_t i = 0; i < R;) {
        size_t i1 = i;
        while (i1 < R && rslot[i1] == rslot[i])
            i1++;
        unsigned d = (unsigned)rslot[i];
        const uint16_t *cs = cand + sbase[d];
        uint64_t cnt = scount[d], hb = sbucket[d] << 16;
        struct extra ex = {0, 0};
        unsigned nex = 0;
        if (sheavy[d]) {
            unsigned hk = (unsigned)sheavy[d] - 1;
            ex.lo = (uint16_t)((uint32_t)c.heavy[hk] ^ 0x80000000u);
            for (unsigned sub = 0; sub < nsub; sub++)
                ex.cnt += heq[(size_t)sub * MAX_HEAVY + hk];
            nex = 1;
        }
        if ((uint64_t)(i1 - i) * 2 * cnt <= 2 * NB + cnt) {
            for (size_t k = i; k < i1; k++) {
                uint64_t in_slot;
                uint16_t lo = select_two_rounds(cs, cnt, &ex, nex, rank[k] - below[k], &in_slot);
                val[k] = sq_unkey((uint32_t)(hb | lo));
                lt[k] = below[k] + in_slot;
            }
        } else {
            uint64_t cm = 0, heavy_lo = ex.lo;
            uint32_t lo = 0;
            for (uint64_t k = 0; k < cnt; k++)
                h[cs[k]]++;
            /* 32-bit counts: a heavy key is walked past by its own count */
            for (size_t k = i; k < i1; k++) {
                uint64_t rr = rank[k] - below[k];
                for (;;) {
                    uint64_t here = h[lo] + (nex && lo == heavy_lo ? ex.cnt : 0);
                    if (cm + here > rr)
                        break;
                    cm += here;
                    lo++;
                }
                val[k] = sq_unkey((uint32_t)(hb | lo));
                lt[k] = below[k] + cm;
            }
            for (uint64_t k = 0; k < cnt; k++)
                h[cs[k]] = 0;
        }
        i = i1;
    }
    return 0;
}
