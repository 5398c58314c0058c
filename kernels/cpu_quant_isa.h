/* The quantized matrix product of cpu_quant.h for one instruction set: included once for
 * AVX2 (`_avx2`, vpmaddwd) and once for AVX-512 VNNI (`_vnni`, vpdpwssd on 256-bit vectors),
 * each function compiled for its own target so one library holds both and the caller picks
 * by the CPU at run time.
 *
 * Expects ISA_ATTR (a target attribute), ISA(f) (the name suffix), DOT2_S16(a, b, c, d):
 * the eight int32 sums of a . b + c . d, four adjacent int16 products each, and for the
 * float tiles a float32 vector type FVEC of FLANES lanes with its FLOAD, FSTORE, FSET1, FFMA
 * and FZERO, and FNW, the weight rows of a tile. It undefines them at its end.
 */

/* A row of k values to blocks of 32 int16 values, their scale d (amax / 32767) and
 * d * sum(q). */
ISA_ATTR static void ISA(quantize_row)(const float *x, int64_t k, int16_t *xq, float *xd,
                                       float *xs)
{
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < k / QK; b++) {
        const float *src = x + b * QK;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(src + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float d = _mm_cvtss_f32(m4) / 32767.0f;
        const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
        __m256i q[4], total = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            q[i] = _mm256_cvtps_epi32(
                _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT));
            total = _mm256_add_epi32(total, q[i]);
        }
        /* packs interleave 128-bit lanes; the 64-bit permutation puts the values in order */
        int16_t *dst = xq + b * QK;
        _mm256_storeu_si256((__m256i *)dst,
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8));
        _mm256_storeu_si256((__m256i *)(dst + 16),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8));
        __m128i t =
            _mm_add_epi32(_mm256_extracti128_si256(total, 1), _mm256_castsi256_si128(total));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        xd[b] = d;
        xs[b] = d * (float)_mm_cvtsi128_si32(t);
    }
}

/* 32 bytes, byte j 16 where bit j of qh is set, else 0: Q5_0/Q5_1's fifth bits. */
ISA_ATTR static inline __m256i ISA(fifth_bits)(uint32_t qh)
{
    const __m256i which = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                           2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), which);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit),
                            _mm256_set1_epi8(16));
}

/* Block b of a row (of nb blocks) as decode_block (cpu_quant.h) gives it: q in two vectors
 * of 16 int16 (values 0..15, 16..31), scale and offset. Inlined with a constant qtype. A
 * QTYPE_DECODED row holds its nb blocks' int16 values, then their nb scales, then their nb
 * offsets. */
ISA_ATTR static inline __attribute__((always_inline)) void
ISA(decode)(const int qtype, const uint8_t *row, int64_t nb, int64_t b, __m256i *lo,
            __m256i *hi, float *scale, float *offset)
{
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256i v; /* 32 unsigned bytes, value j in byte j */
    *offset = 0.0f;
    if (qtype == QTYPE_DECODED) {
        *lo = _mm256_loadu_si256((const __m256i *)(row + b * 64));
        *hi = _mm256_loadu_si256((const __m256i *)(row + b * 64 + 32));
        memcpy(scale, row + nb * 64 + b * 4, sizeof *scale);
        memcpy(offset, row + nb * 68 + b * 4, sizeof *offset);
        return;
    }
    if (qtype == QTYPE_Q8_0) {
        const uint8_t *blk = row + b * 34;
        *scale = fp16_to_f32(blk);
        v = _mm256_loadu_si256((const __m256i *)(blk + 2));
        *lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
        *hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
        return;
    }
    if (qtype == QTYPE_Q4_0 || qtype == QTYPE_Q4_1 || qtype == QTYPE_Q5_0 || qtype == QTYPE_Q5_1) {
        const uint8_t *blk = row + b * block_bytes(qtype);
        const int has_min = qtype == QTYPE_Q4_1 || qtype == QTYPE_Q5_1;
        const int five = qtype == QTYPE_Q5_0 || qtype == QTYPE_Q5_1;
        const __m128i packed =
            _mm_loadu_si128((const __m128i *)(blk + (has_min ? 4 : 2) + (five ? 4 : 0)));
        /* low nibbles are values 0..15, high nibbles 16..31 */
        v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low4);
        if (five) {
            uint32_t qh;
            memcpy(&qh, blk + (has_min ? 4 : 2), sizeof qh);
            v = _mm256_or_si256(v, ISA(fifth_bits)(qh));
        }
        *scale = fp16_to_f32(blk);
        if (has_min)
            *offset = fp16_to_f32(blk + 2);
        const __m256i bias = _mm256_set1_epi16(has_min ? 0 : five ? 16 : 8);
        *lo = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)), bias);
        *hi = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1)), bias);
        return;
    }
    const int j = (int)(b % 8); /* the K-quants: sub-block j of super-block b / 8 */
    const uint8_t *sb = row + b / 8 * block_bytes(qtype);
    if (qtype == QTYPE_Q6_K) {
        const int n = j / 4, t = j % 4;
        const int8_t *sc = (const int8_t *)(sb + 192) + 8 * n + 2 * t;
        v = _mm256_loadu_si256((const __m256i *)(sb + 64 * n + 32 * (t & 1)));
        v = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(4 * (t >> 1))), low4);
        __m256i h = _mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * n));
        h = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * t)), _mm256_set1_epi8(3));
        v = _mm256_or_si256(v, _mm256_slli_epi16(h, 4));
        const __m256i bias = _mm256_set1_epi16(32);
        *scale = fp16_to_f32(sb + 208);
        *lo = _mm256_mullo_epi16(
            _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)), bias),
            _mm256_set1_epi16(sc[0]));
        *hi = _mm256_mullo_epi16(
            _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1)), bias),
            _mm256_set1_epi16(sc[1]));
        return;
    }
    int sc, mn;
    k_scale_min(j, sb + 4, &sc, &mn);
    *scale = fp16_to_f32(sb) * (float)sc;
    *offset = -(fp16_to_f32(sb + 2) * (float)mn);
    const int five = qtype == QTYPE_Q5_K;
    v = _mm256_loadu_si256((const __m256i *)(sb + (five ? 48 : 16) + 32 * (j / 2)));
    v = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(4 * (j & 1))), low4);
    if (five) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(sb + 16));
        h = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
        v = _mm256_or_si256(v, _mm256_slli_epi16(h, 4));
    }
    *lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v));
    *hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1));
}

/* sum(a[i] * b[i]) for i < n, the same way wherever it is called. */
ISA_ATTR static inline float ISA(dot_f32)(const float *a, const float *b, int64_t n)
{
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float sum = hsum8(acc);
    for (; i < n; i++)
        sum += a[i] * b[i];
    return sum;
}

/* NR weight rows against `mt` (at most MT) activation rows: each weight block is decoded
 * once for all mt rows and each activation block loaded once for all NR rows. Weight rows
 * past a tile's end repeat its last row and are not written. Inlined with a constant qtype
 * and mt, so each format and tile height gets its own loop. */
ISA_ATTR static inline __attribute__((always_inline)) void
ISA(tile)(const int qtype, const int mt, const uint8_t *w, int64_t row_bytes, int64_t wrows,
          int64_t nb, const int16_t *xq, const float *xd, const float *xs, int64_t k,
          float *out, int64_t ldo)
{
    const uint8_t *wr[NR];
    const int16_t *xr[MT];
    const float *dr[MT], *sr[MT];
    __m256 acc[NR][MT];
    for (int i = 0; i < NR; i++) {
        wr[i] = w + (i < wrows ? i : wrows - 1) * row_bytes;
        for (int r = 0; r < mt; r++)
            acc[i][r] = _mm256_setzero_ps();
    }
    for (int r = 0; r < mt; r++) {
        xr[r] = xq + r * k;
        dr[r] = xd + r * nb;
        sr[r] = xs + r * nb;
    }
    /* the blocks' offsets (the weight of a zero q) of each row, for sum(offset * d_x sum(q_x))
     * after the blocks: a QTYPE_DECODED row's own, else gathered while decoding */
    const int has_offset = qtype == QTYPE_Q4_1 || qtype == QTYPE_Q5_1 || qtype == QTYPE_Q4_K ||
                           qtype == QTYPE_Q5_K || qtype == QTYPE_DECODED;
    float gathered[has_offset && qtype != QTYPE_DECODED ? NR : 1][nb];
    for (int64_t b = 0; b < nb; b++) {
        __m256i lo[NR], hi[NR];
        __m256 dw[NR];
        for (int i = 0; i < NR; i++) {
            float scale, offset;
            ISA(decode)(qtype, wr[i], nb, b, &lo[i], &hi[i], &scale, &offset);
            dw[i] = _mm256_set1_ps(scale);
            if (has_offset && qtype != QTYPE_DECODED)
                gathered[i][b] = offset;
        }
        for (int r = 0; r < mt; r++) {
            const __m256i xl = _mm256_loadu_si256((const __m256i *)(xr[r] + b * QK));
            const __m256i xh = _mm256_loadu_si256((const __m256i *)(xr[r] + b * QK + 16));
            const __m256 dx = _mm256_broadcast_ss(dr[r] + b);
            for (int i = 0; i < NR; i++) {
                const __m256 dot = _mm256_cvtepi32_ps(DOT2_S16(lo[i], xl, hi[i], xh));
                acc[i][r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw[i], dx), acc[i][r]);
            }
        }
    }
    for (int i = 0; i < NR && i < wrows; i++) {
        const float *offsets =
            qtype == QTYPE_DECODED ? (const float *)(wr[i] + nb * 68) : gathered[i];
        for (int r = 0; r < mt; r++)
            out[r * ldo + i] =
                hsum8(acc[i][r]) + (has_offset ? ISA(dot_f32)(offsets, sr[r], nb) : 0.0f);
    }
}

/* `wrows` rows of w decoded into `into` as QTYPE_DECODED rows. */
ISA_ATTR static inline __attribute__((always_inline)) void
ISA(decode_rows)(const int qtype, const uint8_t *w, int64_t wrows, int64_t k, uint8_t *into)
{
    const int64_t nb = k / QK, row_bytes = row_bytes_of(qtype, k);
    for (int64_t j = 0; j < wrows; j++) {
        uint8_t *row = into + j * nb * DECODED_BYTES;
        for (int64_t b = 0; b < nb; b++) {
            __m256i lo, hi;
            float scale, offset;
            ISA(decode)(qtype, w + j * row_bytes, nb, b, &lo, &hi, &scale, &offset);
            _mm256_storeu_si256((__m256i *)(row + b * 64), lo);
            _mm256_storeu_si256((__m256i *)(row + b * 64 + 32), hi);
            memcpy(row + nb * 64 + b * 4, &scale, sizeof scale);
            memcpy(row + nb * 68 + b * 4, &offset, sizeof offset);
        }
    }
}

/* `wrows` rows of w (from its row w0, the output's column out0, rows ldo apart) against all
 * m rows of x, in tiles, for one format. */
ISA_ATTR static inline __attribute__((always_inline)) void
ISA(chunk)(const int qtype, const uint8_t *w0, int64_t wrows, int64_t ldo, int64_t k,
           const int16_t *xq, const float *xd, const float *xs, int64_t m, float *out0)
{
    const int64_t nb = k / QK, row_bytes = row_bytes_of(qtype, k);
    for (int64_t m0 = 0; m0 < m; m0 += MT) {
        const int64_t rows = m - m0 < MT ? m - m0 : MT;
        const int16_t *x = xq + m0 * k;
        const float *d = xd + m0 * nb, *s = xs + m0 * nb;
        for (int64_t j = 0; j < wrows; j += NR) {
            const uint8_t *wj = w0 + j * row_bytes;
            const int64_t nr = wrows - j < NR ? wrows - j : NR;
            float *o = out0 + m0 * ldo + j;
            if (rows == MT)
                ISA(tile)(qtype, MT, wj, row_bytes, nr, nb, x, d, s, k, o, ldo);
            else if (rows == 3)
                ISA(tile)(qtype, 3, wj, row_bytes, nr, nb, x, d, s, k, o, ldo);
            else if (rows == 2)
                ISA(tile)(qtype, 2, wj, row_bytes, nr, nb, x, d, s, k, o, ldo);
            else
                ISA(tile)(qtype, 1, wj, row_bytes, nr, nb, x, d, s, k, o, ldo);
        }
    }
}

/* Block b of a row (of nb blocks) decoded to float32, w = scale * q + offset, into dst[32]. */
ISA_ATTR static inline __attribute__((always_inline)) void
ISA(decode_f32)(const int qtype, const uint8_t *row, int64_t nb, int64_t b, float *dst)
{
    __m256i lo, hi;
    float scale, offset;
    ISA(decode)(qtype, row, nb, b, &lo, &hi, &scale, &offset);
#if FLANES == 16
    const __m512 s = _mm512_set1_ps(scale), o = _mm512_set1_ps(offset);
    _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(lo)), s, o));
    _mm512_storeu_ps(dst + 16,
                     _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(hi)), s, o));
#else
    const __m256 s = _mm256_set1_ps(scale), o = _mm256_set1_ps(offset);
    const __m128i part[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                             _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
    for (int i = 0; i < 4; i++)
        _mm256_storeu_ps(dst + 8 * i,
                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(part[i])), s, o));
#endif
}

/* `wrows` rows of w decoded to float32 into `into`, k apart. */
ISA_ATTR static inline __attribute__((always_inline)) void
ISA(decode_rows_f32)(const int qtype, const uint8_t *w, int64_t wrows, int64_t k, float *into)
{
    const int64_t nb = k / QK, row_bytes = row_bytes_of(qtype, k);
    for (int64_t j = 0; j < wrows; j++)
        for (int64_t b = 0; b < nb; b++)
            ISA(decode_f32)(qtype, w + j * row_bytes, nb, b, into + j * k + b * QK);
}

/* x [m, k] into xt as groups of xg rows (a vector or two), each group [k, xg] (a value of
 * k's xg rows contiguous), rows past m zero; rows split among the threads (called inside a
 * parallel region): each row is read in order, its values stored xg apart. */
ISA_ATTR static inline void ISA(group_x)(const float *x, int64_t m, int64_t k, float *xt,
                                         int64_t xg)
{
    const int64_t rows = (m + xg - 1) / xg * xg;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *dst = xt + r / xg * k * xg + r % xg;
        const float *src = x + r * k;
        if (r < m)
            for (int64_t c = 0; c < k; c++)
                dst[c * xg] = src[c];
        else
            for (int64_t c = 0; c < k; c++)
                dst[c * xg] = 0.0f;
    }
}

/* `nr` (at most FNW) rows of w, from row w0, against all m rows of x (in groups of xv
 * vectors in xt), into out0's columns: k goes by in blocks of KB values, each block of the
 * nr rows decoded to float32 into `wb` (small enough to stay in the first-level cache) and
 * multiplied by every group of x in turn, a group's FNW x xv accumulator vectors kept in
 * `acc` between blocks. Per value of k: xv vectors of x and a broadcast weight per row, no
 * horizontal sums. Inlined with a constant qtype and xv. */
ISA_ATTR static inline __attribute__((always_inline)) void
ISA(float_rows)(const int qtype, const int xv, const uint8_t *w0, int64_t nr, int64_t k,
                const float *xt, int64_t m, float *out0, int64_t ldo, float *wb, FVEC *acc)
{
    const int64_t xg = xv * FLANES, groups = (m + xg - 1) / xg;
    const int64_t row_bytes = row_bytes_of(qtype, k), nb = k / QK;
    for (int64_t k0 = 0; k0 < k; k0 += KB) {
        const int64_t len = k - k0 < KB ? k - k0 : KB;
        for (int j = 0; j < FNW; j++) /* rows past nr repeat the last, not written */
            for (int64_t b = k0 / QK; b < (k0 + len) / QK; b++)
                ISA(decode_f32)(qtype, w0 + (j < nr ? j : nr - 1) * row_bytes, nb, b,
                                wb + j * KB + (b * QK - k0));
        for (int64_t g = 0; g < groups; g++) {
            FVEC a[FNW][2];
            FVEC *saved = acc + g * FNW * 2;
#pragma GCC unroll 16
            for (int j = 0; j < FNW; j++) {
                a[j][0] = k0 ? saved[2 * j] : FZERO();
                a[j][1] = k0 ? saved[2 * j + 1] : FZERO();
            }
            const float *xc = xt + g * k * xg + k0 * xg;
            for (int64_t c = 0; c < len; c++, xc += xg) {
                const FVEC x0 = FLOAD(xc), x1 = xv > 1 ? FLOAD(xc + FLANES) : FZERO();
#pragma GCC unroll 16
                for (int j = 0; j < FNW; j++) {
                    const FVEC wv = FSET1(wb[j * KB + c]);
                    a[j][0] = FFMA(wv, x0, a[j][0]);
                    if (xv > 1)
                        a[j][1] = FFMA(wv, x1, a[j][1]);
                }
            }
            if (k0 + len < k) {
#pragma GCC unroll 16
                for (int j = 0; j < FNW; j++) {
                    saved[2 * j] = a[j][0];
                    saved[2 * j + 1] = a[j][1];
                }
                continue;
            }
            const int64_t rows = m - g * xg < xg ? m - g * xg : xg;
            for (int j = 0; j < nr; j++) {
                float lanes[2 * FLANES];
                FSTORE(lanes, a[j][0]);
                if (xv > 1)
                    FSTORE(lanes + FLANES, a[j][1]);
                for (int64_t r = 0; r < rows; r++)
                    out0[(g * xg + r) * ldo + j] = lanes[r];
            }
        }
    }
}

/* The float-tile product, for several activation rows: each tile of FNW weight rows is
 * decoded to float32 a block of k at a time and multiplied by x as it is, so the weight's
 * integers cost one conversion per value rather than one per block and activation row, and
 * the product is the dequantize-then-matmul one. Returns -1 where a buffer cannot be had. */
ISA_ATTR static int ISA(float_matmul)(int qtype, const uint8_t *w, int64_t n, int64_t k,
                                      const float *x, int64_t m, float *out, int64_t ldo)
{
    const int xv = m > FLANES ? 2 : 1; /* vectors of x per group: one where one holds m */
    const int64_t xg = xv * FLANES, groups = (m + xg - 1) / xg, tiles = (n + FNW - 1) / FNW;
    float *xt = malloc(sizeof(float) * (size_t)(groups * xg * k));
    if (xt == NULL)
        return -1;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        ISA(group_x)(x, m, k, xt, xg);
        float *wb = aligned_alloc(64, sizeof(float) * FNW * KB);
        FVEC *acc = aligned_alloc(64, sizeof(FVEC) * (size_t)(groups * FNW * 2));
        failed = wb == NULL || acc == NULL;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (wb == NULL || acc == NULL)
                continue;
            const int64_t n0 = t * FNW, nr = n - n0 < FNW ? n - n0 : FNW;
            const uint8_t *w0 = w + n0 * row_bytes_of(qtype, k);
#define FLOAT_ROWS(q)                                                                   \
    (xv > 1 ? ISA(float_rows)(q, 2, w0, nr, k, xt, m, out + n0, ldo, wb, acc)           \
            : ISA(float_rows)(q, 1, w0, nr, k, xt, m, out + n0, ldo, wb, acc))
            BY_FORMAT(qtype, FLOAT_ROWS)
#undef FLOAT_ROWS
        }
        free(wb);
        free(acc);
    }
    free(xt);
    return failed ? -1 : 0;
}

/* All n rows of w decoded to float32 into out [n, k], rows split among the threads. */
ISA_ATTR static void ISA(dequantize)(int qtype, const uint8_t *w, int64_t n, int64_t k, float *out)
{
    const int64_t chunks = (n + NCHUNK - 1) / NCHUNK, row_bytes = row_bytes_of(qtype, k);
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * NCHUNK, rows = n0 + NCHUNK < n ? NCHUNK : n - n0;
        const uint8_t *w0 = w + n0 * row_bytes;
        float *o = out + n0 * k;
#define DECODE_ROWS(q) ISA(decode_rows_f32)(q, w0, rows, k, o)
        BY_FORMAT(qtype, DECODE_ROWS)
#undef DECODE_ROWS
    }
}

/* One format's chunks: decoded once into `scratch` where more than one activation tile
 * reads them (scratch non-NULL), else decoded in each tile. */
ISA_ATTR static inline __attribute__((always_inline)) void
ISA(format_chunk)(const int qtype, const uint8_t *w, int64_t n0, int64_t n1, int64_t ldo, int64_t k,
                  const int16_t *xq, const float *xd, const float *xs, int64_t m, float *out,
                  uint8_t *scratch)
{
    const uint8_t *w0 = w + n0 * row_bytes_of(qtype, k);
    if (scratch == NULL) {
        ISA(chunk)(qtype, w0, n1 - n0, ldo, k, xq, xd, xs, m, out + n0);
        return;
    }
    ISA(decode_rows)(qtype, w0, n1 - n0, k, scratch);
    ISA(chunk)(QTYPE_DECODED, scratch, n1 - n0, ldo, k, xq, xd, xs, m, out + n0);
}

/* out[m, n] = x[m, k] . dequant(w)[n, k] (out's rows ldo apart), in one parallel region: x
 * quantized per block of 32 into xq/xd/xs first, before the region where it is a few rows (a
 * barrier less: on a loaded machine every barrier can wait out a descheduled thread's time
 * slice), else a row per thread. Then rows of w are split
 * among the threads in chunks of NCHUNK; within a chunk the activations go by in tiles of MT
 * rows, so a chunk's weight blocks come from memory once and from cache after. With more
 * than one tile, a chunk is decoded to int16 once into a per-thread buffer (a failed
 * allocation falls back to decoding in every tile). */
ISA_ATTR static void ISA(quant_matmul)(int qtype, const uint8_t *w, int64_t n, int64_t k,
                                       const float *x, int64_t m, int16_t *xq, float *xd,
                                       float *xs, float *out, int64_t ldo)
{
    const int64_t chunks = (n + NCHUNK - 1) / NCHUNK, nb = k / QK;
    const int serial = m <= 4 * MT;
    if (serial)
        for (int64_t r = 0; r < m; r++)
            ISA(quantize_row)(x + r * k, k, xq + r * k, xd + r * nb, xs + r * nb);
#pragma omp parallel
    {
        if (!serial) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++)
                ISA(quantize_row)(x + r * k, k, xq + r * k, xd + r * nb, xs + r * nb);
        }
        uint8_t *scratch = m > MT ? malloc((size_t)(NCHUNK * nb * DECODED_BYTES)) : NULL;
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n0 = c * NCHUNK, n1 = n0 + NCHUNK < n ? n0 + NCHUNK : n;
#define FORMAT_CHUNK(q) ISA(format_chunk)(q, w, n0, n1, ldo, k, xq, xd, xs, m, out, scratch)
            BY_FORMAT(qtype, FORMAT_CHUNK)
#undef FORMAT_CHUNK
        }
        free(scratch);
    }
}

#undef ISA_ATTR
#undef ISA
#undef DOT2_S16
#undef FLANES
#undef FNW
#undef FVEC
#undef FLOAD
#undef FSTORE
#undef FSET1
#undef FFMA
#undef FZERO
