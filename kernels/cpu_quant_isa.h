/* The quantized matrix product of cpu_quant.h for one instruction set: included once for
 * AVX2 (`_avx2`, vpmaddubsw + vpmaddwd) and once for AVX-512 VNNI (`_vnni`, vpdpbusd on
 * 256-bit vectors), each function compiled for its own target so one library holds both and
 * the caller picks by the CPU at run time.
 *
 * Expects ISA_ATTR (a target attribute), ISA(f) (the name suffix) and DOT_U8S8(u, s): the
 * eight int32 sums of four adjacent u8 x s8 products of two 32-byte vectors.
 */

/* x rows [m, k] to Q8 blocks: 32 int8 values, their scale d (amax / 127) and d * sum(q). */
ISA_ATTR static void ISA(quantize_rows)(const float *x, int64_t m, int64_t k, int8_t *xq,
                                        float *xd, float *xs)
{
    const int64_t nb = k / QK;
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *src = x + r * k + b * QK;
            __m256 v[4], amax = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(src + 8 * i);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[i]));
            }
            __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float d = _mm_cvtss_f32(m4) / 127.0f;
            const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
            __m256i q[4], total = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                q[i] = _mm256_cvtps_epi32(
                    _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT));
                total = _mm256_add_epi32(total, q[i]);
            }
            /* packs interleave 128-bit lanes; the permutation puts the 32 values in order */
            const __m256i q01 = _mm256_packs_epi32(q[0], q[1]);
            const __m256i q23 = _mm256_packs_epi32(q[2], q[3]);
            const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q01, q23), order);
            _mm256_storeu_si256((__m256i *)(xq + r * k + b * QK), packed);
            __m128i t = _mm_add_epi32(_mm256_extracti128_si256(total, 1),
                                      _mm256_castsi256_si128(total));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
            t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
            xd[r * nb + b] = d;
            xs[r * nb + b] = d * (float)_mm_cvtsi128_si32(t);
        }
    }
}

/* NR weight rows against MT activation rows: each weight block is unpacked once for all MT
 * rows and each activation block loaded once for all NR rows. Rows past a tile's end repeat
 * its last row and are not written. Inlined with a constant qtype, so each format gets its
 * own loop. */
ISA_ATTR static inline __attribute__((always_inline)) void
ISA(tile)(const int qtype, const uint8_t *w, int64_t row_bytes, int64_t wrows, int64_t nb,
          const int8_t *xq, const float *xd, const float *xs, int64_t k, int64_t rows, float *out,
          int64_t ldo)
{
    const uint8_t *wr[NR];
    const int8_t *xr[MT];
    const float *dr[MT], *sr[MT];
    __m256 acc[NR][MT];
    float corr[NR][MT];
    for (int i = 0; i < NR; i++) {
        wr[i] = w + (i < wrows ? i : wrows - 1) * row_bytes;
        for (int r = 0; r < MT; r++) {
            acc[i][r] = _mm256_setzero_ps();
            corr[i][r] = 0.0f;
        }
    }
    for (int r = 0; r < MT; r++) {
        const int64_t row = r < rows ? r : rows - 1;
        xr[r] = xq + row * k;
        dr[r] = xd + row * nb;
        sr[r] = xs + row * nb;
    }
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const int64_t bytes = (int64_t)block_bytes(qtype);
    for (int64_t b = 0; b < nb; b++) {
        __m256i u[NR], wsign[NR];
        float dw[NR], offset[NR]; /* offset: the weight of a zero nibble, times d_x sum(q_x) */
        for (int i = 0; i < NR; i++) {
            const uint8_t *blk = wr[i] + b * bytes;
            dw[i] = fp16_to_f32(blk);
            if (qtype == QTYPE_Q8_0) {
                wsign[i] = _mm256_loadu_si256((const __m256i *)(blk + 2));
                u[i] = _mm256_sign_epi8(wsign[i], wsign[i]); /* |w|; x takes w's sign */
                offset[i] = 0.0f;
            } else {
                const __m128i packed =
                    _mm_loadu_si128((const __m128i *)(blk + (qtype == QTYPE_Q4_1 ? 4 : 2)));
                /* low nibbles are values 0..15, high nibbles 16..31 */
                u[i] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low4);
                offset[i] = qtype == QTYPE_Q4_1 ? fp16_to_f32(blk + 2) : -8.0f * dw[i];
            }
        }
        for (int r = 0; r < MT; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xr[r] + b * QK));
            const float dx = dr[r][b], sx = sr[r][b];
            for (int i = 0; i < NR; i++) {
                const __m256i s = qtype == QTYPE_Q8_0 ? _mm256_sign_epi8(x, wsign[i]) : x;
                const __m256 dot = _mm256_cvtepi32_ps(DOT_U8S8(u[i], s));
                acc[i][r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw[i] * dx), acc[i][r]);
                if (qtype != QTYPE_Q8_0)
                    corr[i][r] += offset[i] * sx;
            }
        }
    }
    for (int i = 0; i < NR && i < wrows; i++)
        for (int r = 0; r < MT && r < rows; r++)
            out[r * ldo + i] = hsum8(acc[i][r]) + corr[i][r];
}

/* The rows [n0, n1) of w against all m rows of x, in tiles, for one format. */
ISA_ATTR static inline __attribute__((always_inline)) void
ISA(chunk)(const int qtype, const uint8_t *w, int64_t n0, int64_t n1, int64_t n, int64_t k,
           const int8_t *xq, const float *xd, const float *xs, int64_t m, float *out)
{
    const int64_t nb = k / QK, row_bytes = nb * (int64_t)block_bytes(qtype);
    for (int64_t m0 = 0; m0 < m; m0 += MT) {
        const int64_t rows = m - m0 < MT ? m - m0 : MT;
        for (int64_t j = n0; j < n1; j += NR)
            ISA(tile)(qtype, w + j * row_bytes, row_bytes, n1 - j < NR ? n1 - j : NR, nb,
                      xq + m0 * k, xd + m0 * nb, xs + m0 * nb, k, rows, out + m0 * n + j, n);
    }
}

/* out[m, n] = x[m, k] . dequant(w)[n, k], x quantized per block of 32 first. Rows of w are
 * split among the threads in chunks of NCHUNK; within a chunk the activations go by in
 * tiles of MT rows, so a chunk's weight blocks come from memory once and from L1 after. */
ISA_ATTR static void ISA(quant_matmul)(int qtype, const uint8_t *w, int64_t n, int64_t k,
                                       const int8_t *xq, const float *xd, const float *xs,
                                       int64_t m, float *out)
{
    const int64_t chunks = (n + NCHUNK - 1) / NCHUNK;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * NCHUNK, n1 = n0 + NCHUNK < n ? n0 + NCHUNK : n;
        if (qtype == QTYPE_Q8_0)
            ISA(chunk)(QTYPE_Q8_0, w, n0, n1, n, k, xq, xd, xs, m, out);
        else if (qtype == QTYPE_Q4_1)
            ISA(chunk)(QTYPE_Q4_1, w, n0, n1, n, k, xq, xd, xs, m, out);
        else
            ISA(chunk)(QTYPE_Q4_0, w, n0, n1, n, k, xq, xd, xs, m, out);
    }
}
