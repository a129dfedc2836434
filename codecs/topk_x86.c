/* topk's AVX2 kernels, picked at run time: the emit pass and the window
 * pass, each packing the wanted lanes of 8 entries with one permute. */
#include "topk_impl.h"

#if TOPK_X86
#include <immintrin.h>

/* Lane order of the kept lanes of an 8-lane mask, 3 bits per lane. */
static const uint32_t topk_pack_lanes[256] = {
    0x000000, 0x000000, 0x000001, 0x000008, 0x000002, 0x000010, 0x000011, 0x000088, 0x000003,
    0x000018, 0x000019, 0x0000c8, 0x00001a, 0x0000d0, 0x0000d1, 0x000688, 0x000004, 0x000020,
    0x000021, 0x000108, 0x000022, 0x000110, 0x000111, 0x000888, 0x000023, 0x000118, 0x000119,
    0x0008c8, 0x00011a, 0x0008d0, 0x0008d1, 0x004688, 0x000005, 0x000028, 0x000029, 0x000148,
    0x00002a, 0x000150, 0x000151, 0x000a88, 0x00002b, 0x000158, 0x000159, 0x000ac8, 0x00015a,
    0x000ad0, 0x000ad1, 0x005688, 0x00002c, 0x000160, 0x000161, 0x000b08, 0x000162, 0x000b10,
    0x000b11, 0x005888, 0x000163, 0x000b18, 0x000b19, 0x0058c8, 0x000b1a, 0x0058d0, 0x0058d1,
    0x02c688, 0x000006, 0x000030, 0x000031, 0x000188, 0x000032, 0x000190, 0x000191, 0x000c88,
    0x000033, 0x000198, 0x000199, 0x000cc8, 0x00019a, 0x000cd0, 0x000cd1, 0x006688, 0x000034,
    0x0001a0, 0x0001a1, 0x000d08, 0x0001a2, 0x000d10, 0x000d11, 0x006888, 0x0001a3, 0x000d18,
    0x000d19, 0x0068c8, 0x000d1a, 0x0068d0, 0x0068d1, 0x034688, 0x000035, 0x0001a8, 0x0001a9,
    0x000d48, 0x0001aa, 0x000d50, 0x000d51, 0x006a88, 0x0001ab, 0x000d58, 0x000d59, 0x006ac8,
    0x000d5a, 0x006ad0, 0x006ad1, 0x035688, 0x0001ac, 0x000d60, 0x000d61, 0x006b08, 0x000d62,
    0x006b10, 0x006b11, 0x035888, 0x000d63, 0x006b18, 0x006b19, 0x0358c8, 0x006b1a, 0x0358d0,
    0x0358d1, 0x1ac688, 0x000007, 0x000038, 0x000039, 0x0001c8, 0x00003a, 0x0001d0, 0x0001d1,
    0x000e88, 0x00003b, 0x0001d8, 0x0001d9, 0x000ec8, 0x0001da, 0x000ed0, 0x000ed1, 0x007688,
    0x00003c, 0x0001e0, 0x0001e1, 0x000f08, 0x0001e2, 0x000f10, 0x000f11, 0x007888, 0x0001e3,
    0x000f18, 0x000f19, 0x0078c8, 0x000f1a, 0x0078d0, 0x0078d1, 0x03c688, 0x00003d, 0x0001e8,
    0x0001e9, 0x000f48, 0x0001ea, 0x000f50, 0x000f51, 0x007a88, 0x0001eb, 0x000f58, 0x000f59,
    0x007ac8, 0x000f5a, 0x007ad0, 0x007ad1, 0x03d688, 0x0001ec, 0x000f60, 0x000f61, 0x007b08,
    0x000f62, 0x007b10, 0x007b11, 0x03d888, 0x000f63, 0x007b18, 0x007b19, 0x03d8c8, 0x007b1a,
    0x03d8d0, 0x03d8d1, 0x1ec688, 0x00003e, 0x0001f0, 0x0001f1, 0x000f88, 0x0001f2, 0x000f90,
    0x000f91, 0x007c88, 0x0001f3, 0x000f98, 0x000f99, 0x007cc8, 0x000f9a, 0x007cd0, 0x007cd1,
    0x03e688, 0x0001f4, 0x000fa0, 0x000fa1, 0x007d08, 0x000fa2, 0x007d10, 0x007d11, 0x03e888,
    0x000fa3, 0x007d18, 0x007d19, 0x03e8c8, 0x007d1a, 0x03e8d0, 0x03e8d1, 0x1f4688, 0x0001f5,
    0x000fa8, 0x000fa9, 0x007d48, 0x000faa, 0x007d50, 0x007d51, 0x03ea88, 0x000fab, 0x007d58,
    0x007d59, 0x03eac8, 0x007d5a, 0x03ead0, 0x03ead1, 0x1f5688, 0x000fac, 0x007d60, 0x007d61,
    0x03eb08, 0x007d62, 0x03eb10, 0x03eb11, 0x1f5888, 0x007d63, 0x03eb18, 0x03eb19, 0x1f58c8,
    0x03eb1a, 0x1f58d0, 0x1f58d1, 0xfac688,
};

/* The emit pass for 32-bit indices with AVX2: 8 entries at a time, the
 * kept ones packed to the front of the buffers by a lane permute; a group
 * holding an entry equal to T takes the scalar steps (its quota). */
__attribute__((target("avx2,popcnt"))) void epipe_topk_emit_avx2(topk_job *j, size_t b, size_t e,
                                                                 uint64_t o, uint64_t quota)
{
    const float *restrict x = j->x;
    const uint32_t thr = j->thr;
    const __m256i thrv = _mm256_set1_epi32((int)thr), absm = _mm256_set1_epi32(0x7fffffff);
    const __m256i sh = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21), seven = _mm256_set1_epi32(7);
    uint32_t ib[2 * TOPK_RUN + 8];
    float vb[2 * TOPK_RUN + 8];
    unsigned cnt = 0;
    for (size_t i0 = b; i0 < e; i0 += TOPK_RUN) {
        size_t i1 = e - i0 < TOPK_RUN ? e : i0 + TOPK_RUN, i = i0;
        __m256i iv = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)i0),
                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (; i + 8 <= i1; i += 8, iv = _mm256_add_epi32(iv, _mm256_set1_epi32(8))) {
            __m256 v = _mm256_loadu_ps(x + i);
            __m256i m = _mm256_and_si256(_mm256_castps_si256(v), absm);
            if (!_mm256_testz_si256(_mm256_cmpeq_epi32(m, thrv), _mm256_cmpeq_epi32(m, thrv))) {
                for (size_t l = i; l < i + 8; l++) {
                    uint32_t ml = epipe_topk_mag(x[l]);
                    unsigned eq = ml == thr && quota != 0;
                    ib[cnt] = (uint32_t)l;
                    vb[cnt] = x[l];
                    quota -= eq;
                    cnt += (ml > thr) | eq;
                }
                continue;
            }
            unsigned mask = (unsigned)_mm256_movemask_ps(
                _mm256_castsi256_ps(_mm256_cmpgt_epi32(m, thrv)));
            __m256i perm = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32((int)topk_pack_lanes[mask]), sh), seven);
            _mm256_storeu_si256((__m256i *)(ib + cnt), _mm256_permutevar8x32_epi32(iv, perm));
            _mm256_storeu_ps(vb + cnt, _mm256_permutevar8x32_ps(v, perm));
            cnt += (unsigned)__builtin_popcount(mask);
        }
        for (; i < i1; i++) {
            uint32_t ml = epipe_topk_mag(x[i]);
            unsigned eq = ml == thr && quota != 0;
            ib[cnt] = (uint32_t)i;
            vb[cnt] = x[i];
            quota -= eq;
            cnt += (ml > thr) | eq;
        }
        if (cnt >= TOPK_RUN || i1 == e) {
            memcpy(j->idx + o * 4, ib, (size_t)cnt * 4);
            memcpy(j->val + o * 4, vb, (size_t)cnt * 4);
            o += cnt;
            cnt = 0;
        }
    }
}

/* The window pass with AVX2: 8 entries a step, counted by compares and the
 * window's lanes packed to the front of the candidate buffer by one permute
 * (the buffer has 8 slots of slack). Counts as the portable loop. */
__attribute__((target("avx2,popcnt"))) void epipe_topk_window_avx2(topk_job *j, size_t b, size_t e,
                                                                   unsigned t)
{
    const float *restrict x = j->x;
    uint32_t *restrict c = j->wcand + (size_t)t * (j->wcap + 8);
    const __m256i absm = _mm256_set1_epi32(0x7fffffff);
    const __m256i lo1 = _mm256_set1_epi32((int)(j->wlo - 1)), hi = _mm256_set1_epi32((int)j->whi);
    const __m256i inf1 = _mm256_set1_epi32(0x7f7fffff);
    const __m256i sh = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21), seven = _mm256_set1_epi32(7);
    __m256i above = _mm256_setzero_si256(), bad = _mm256_setzero_si256();
    size_t cnt = 0, cap = j->wcap, i = b;
    uint64_t ab = 0, nf = 0;
    for (; i + 8 <= e; i += 8) {
        __m256i m = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), absm);
        __m256i gt = _mm256_cmpgt_epi32(m, hi); /* magnitudes are < 2^31: signed works */
        above = _mm256_sub_epi32(above, gt);
        bad = _mm256_sub_epi32(bad, _mm256_cmpgt_epi32(m, inf1));
        __m256i in = _mm256_andnot_si256(gt, _mm256_cmpgt_epi32(m, lo1));
        unsigned mask = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(in));
        if (mask) {
            __m256i perm = _mm256_and_si256(
                _mm256_srlv_epi32(_mm256_set1_epi32((int)topk_pack_lanes[mask]), sh), seven);
            _mm256_storeu_si256((__m256i *)(c + cnt), _mm256_permutevar8x32_epi32(m, perm));
            cnt += (unsigned)__builtin_popcount(mask);
            if (cnt > cap)
                break;
        }
        if ((i - b) % ((size_t)1 << 24) == 0) { /* 32-bit lane counts: drain now and then */
            uint32_t tmp[8];
            _mm256_storeu_si256((__m256i *)tmp, above);
            for (unsigned l = 0; l < 8; l++)
                ab += tmp[l];
            _mm256_storeu_si256((__m256i *)tmp, bad);
            for (unsigned l = 0; l < 8; l++)
                nf += tmp[l];
            above = bad = _mm256_setzero_si256();
        }
    }
    uint32_t tmp[8];
    _mm256_storeu_si256((__m256i *)tmp, above);
    for (unsigned l = 0; l < 8; l++)
        ab += tmp[l];
    _mm256_storeu_si256((__m256i *)tmp, bad);
    for (unsigned l = 0; l < 8; l++)
        nf += tmp[l];
    for (; i < e && cnt <= cap; i++) {
        uint32_t m = epipe_topk_mag(x[i]);
        ab += m > j->whi;
        nf += m >= 0x7f800000u;
        if (m >= j->wlo && m <= j->whi)
            c[cnt++] = m;
    }
    j->wcount[t] = cnt > cap ? SIZE_MAX : cnt;
    j->wabove[t] = ab;
    j->wbad[t] = nf;
}

#endif
