/* The kernels of cpu_ops.c for one storage type, included once per type.
 *
 * The includer defines:
 *   T         the element type of activations, weights and the KV cache (float or bf16_t)
 *   NAME(f)   the exported name of kernel f for this type (f##_f32, f##_bf16)
 *   FROM(v)   T -> float
 *   TO(v)     float -> T (rounding)
 *   ROUND(v)  float -> float rounded to T's precision: where transformers rounds an
 *             intermediate to the model's dtype, so do we (identity for float)
 *   LOAD8(p)  eight consecutive T at p as an __m256 (AVX2 builds only)
 * Everything is computed in float32 whatever T is; only loads and stores convert, so the
 * float instantiation is exactly the float32 kernels.
 */

/* Fold the keys kp[0..len) and values vp[0..len) into one query head's state: `m`, `l` and
 * the unnormalised output `acc`. Portable C; the AVX2 version below is the fast path. */
static inline void NAME(attend_generic)(const float *qg, float *acc, float *m, float *l,
                                        const T *const *kp, const T *const *vp, int64_t len,
                                        int64_t head_dim, float *sc)
{
    for (int64_t t = 0; t < len; t++) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; d++)
            dot += qg[d] * FROM(kp[t][d]);
        sc[t] = dot;
    }
    const float alpha = softmax_update(sc, len, scores_max(sc, len), m, l);
    for (int64_t d = 0; d < head_dim; d++)
        acc[d] *= alpha;
    for (int64_t t = 0; t < len; t++) {
        const float p = sc[t];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++)
            acc[d] += p * FROM(vp[t][d]);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* attend_generic for head sizes that are multiples of 8. Eight keys are scored at once with
 * eight independent accumulators (one dot product alone would wait on its own chain of
 * fused multiply-adds), and the output stays in registers across the chunk. `kp` must
 * have a multiple of 8 entries, the padding pointing at any valid key. Inlined per head
 * size so that the inner loops have constant bounds. */
static inline __attribute__((always_inline)) void
NAME(attend_avx2)(const float *qg, float *acc, float *m, float *l, const T *const *kp,
                  const T *const *vp, int64_t len, const int64_t head_dim, float *sc)
{
    const int64_t nc = head_dim / 8;
    /* Padding rows past len repeat the last key, so their scores may join the maximum. */
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (int64_t t0 = 0; t0 < len; t0 += 8) {
        __m256 part[8];
        for (int64_t j = 0; j < 8; j++)
            part[j] = _mm256_setzero_ps();
        for (int64_t c = 0; c < nc; c++) {
            const __m256 qv = _mm256_loadu_ps(qg + 8 * c);
            for (int64_t j = 0; j < 8; j++)
                part[j] = _mm256_fmadd_ps(qv, LOAD8(kp[t0 + j] + 8 * c), part[j]);
        }
        const __m256 scores = sum8(part);
        vmax = _mm256_max_ps(scores, vmax); /* a NaN score yields vmax, as in scores_max */
        _mm256_storeu_ps(sc + t0, scores);
    }
    const __m256 alpha = _mm256_set1_ps(softmax_update(sc, len, hmax8(vmax), m, l));
    for (int64_t c0 = 0; c0 < nc; c0 += 8) {
        const int64_t cb = nc - c0 < 8 ? nc - c0 : 8;
        __m256 r[8];
        for (int64_t c = 0; c < cb; c++)
            r[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * (c0 + c)), alpha);
        for (int64_t t = 0; t < len; t++) {
            const __m256 p = _mm256_set1_ps(sc[t]);
            for (int64_t c = 0; c < cb; c++)
                r[c] = _mm256_fmadd_ps(p, LOAD8(vp[t] + 8 * (c0 + c)), r[c]);
        }
        for (int64_t c = 0; c < cb; c++)
            _mm256_storeu_ps(acc + 8 * (c0 + c), r[c]);
    }
}
#endif

/* One query head's chunk, by the fastest path the head size allows. */
static inline void NAME(attend)(const float *qg, float *acc, float *m, float *l,
                                const T *const *kp, const T *const *vp, int64_t len,
                                int64_t head_dim, float *sc)
{
#if defined(__AVX2__) && defined(__FMA__)
    if (head_dim == 64)
        NAME(attend_avx2)(qg, acc, m, l, kp, vp, len, 64, sc);
    else if (head_dim == 128)
        NAME(attend_avx2)(qg, acc, m, l, kp, vp, len, 128, sc);
    else if (head_dim % 8 == 0)
        NAME(attend_avx2)(qg, acc, m, l, kp, vp, len, head_dim, sc);
    else
#endif
        NAME(attend_generic)(qg, acc, m, l, kp, vp, len, head_dim, sc);
}

/* The K and V rows of keys start .. start + CHUNK of one KV head (rows past `visible`
 * repeat the last key: padding for the 8-wide scoring), and with `prefetch` a prefetch of
 * each: filled one chunk ahead, so that the next chunk's scattered rows come from memory
 * while this one's are computed on. A decode reads each row once and otherwise waits on
 * every one; a prefill chunk's tokens read the same rows again and again from the caches,
 * where the prefetches only cost (prefill attention measured about 10% slower with them). */
static inline void NAME(chunk_rows)(const int32_t *table, int64_t start, int64_t visible,
                                    int64_t block_size, int64_t row, int64_t head_dim,
                                    const T *k_head, const T *v_head, const T **kp,
                                    const T **vp, int prefetch)
{
    const int64_t len = visible - start < CHUNK ? visible - start : CHUNK;
    const int64_t bytes = head_dim * (int64_t)sizeof(T);
    int64_t b = start / block_size, off = start % block_size;
    for (int64_t t = 0; t < CHUNK; t++) {
        const int64_t slot = (int64_t)table[b] * block_size + off;
        kp[t] = k_head + slot * row;
        vp[t] = v_head + slot * row;
        if (prefetch && t < len)
            for (int64_t c = 0; c < bytes; c += 64) {
                __builtin_prefetch((const char *)kp[t] + c, 0, 3);
                __builtin_prefetch((const char *)vp[t] + c, 0, 3);
            }
        if (t + 1 < len && ++off == block_size) {
            off = 0;
            b++;
        }
    }
}

/* Causal attention of new query tokens over a paged K/V cache.
 *
 * Same semantics as kernels.reference.paged_attention_torch, for decodes and prefill chunks
 * alike. Work items are (tile of up to QTILE consecutive query tokens of one sequence, KV
 * head); each walks its keys CHUNK at a time (whatever the block size) with an online
 * softmax per query head, for every token of the tile and every query head of its KV head,
 * so each chunk of K/V rows is read from memory once per tile and then from L1: a prefill
 * token reads every key before it, and one token per item streamed a long prompt's K/V
 * through the caches once per token. Measured here about twice as fast as SDPA on prefill
 * chunks, gathers included, so one kernel serves the whole batch.
 *
 * With `window` > 0 a token at position p sees only keys p - window < k <= p: the tile walks
 * from its first token's oldest visible key, never reading the blocks before it.
 */
void NAME(paged_attention)(
    const T *q, int64_t q_stride, T *out, const T *k_cache, const T *v_cache,
    const int32_t *cu_seqlens_q, const int32_t *seq_lens, const int32_t *block_tables,
    int64_t max_blocks, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, int64_t window)
{
    /* Tiles: (sequence, first token), in token order. */
    int64_t num_tiles = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        num_tiles += (cu_seqlens_q[s + 1] - cu_seqlens_q[s] + QTILE - 1) / QTILE;
    int32_t *tile_seq = malloc(sizeof(int32_t) * (num_tiles ? num_tiles : 1));
    int32_t *tile_tok = malloc(sizeof(int32_t) * (num_tiles ? num_tiles : 1));
    for (int64_t s = 0, n = 0; s < num_seqs; s++)
        for (int32_t t = cu_seqlens_q[s]; t < cu_seqlens_q[s + 1]; t += QTILE, n++) {
            tile_seq[n] = (int32_t)s;
            tile_tok[n] = t;
        }
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* elements per cached token */
    const int64_t per_tok = group * head_dim;     /* a token's query heads of one KV head */

#pragma omp parallel
    {
        /* Per thread: the tile's scaled queries and running outputs, heap not stack (up to
         * QTILE * MAX_GROUP * MAX_HEAD_DIM floats each). */
        float *qs = malloc(sizeof(float) * QTILE * MAX_GROUP * MAX_HEAD_DIM);
        float *acc = malloc(sizeof(float) * QTILE * MAX_GROUP * MAX_HEAD_DIM);
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < num_tiles * num_kv_heads; w++) {
            const int32_t s = tile_seq[w / num_kv_heads];
            const int64_t tok0 = tile_tok[w / num_kv_heads];
            const int64_t kh = w % num_kv_heads;
            const int32_t q0 = cu_seqlens_q[s], qlen = cu_seqlens_q[s + 1] - q0;
            const int64_t ntok = q0 + qlen - tok0 < QTILE ? q0 + qlen - tok0 : QTILE;
            /* keys visible to the tile's first token; token j sees j more */
            const int64_t vis0 = seq_lens[s] - qlen + (tok0 - q0) + 1;
            const int64_t vis_last = vis0 + ntok - 1;
            /* the oldest key the first token sees; token j's is j later */
            const int64_t lo0 = window > 0 && vis0 > window ? vis0 - window : 0;
            const int32_t *table = block_tables + (int64_t)s * max_blocks;

            float m[QTILE * MAX_GROUP], l[QTILE * MAX_GROUP], sc[CHUNK];
            const T *kp[2][CHUNK], *vp[2][CHUNK]; /* this chunk's rows, and the next's */
            const T *kpj[CHUNK], *vpj[CHUNK];     /* padded for a token that sees fewer */
            for (int64_t j = 0; j < ntok; j++)
                for (int64_t g = 0; g < group; g++) {
                    const T *qg = q + (tok0 + j) * q_stride + (kh * group + g) * head_dim;
                    float *qd = qs + j * per_tok + g * head_dim;
                    float *ad = acc + j * per_tok + g * head_dim;
                    for (int64_t d = 0; d < head_dim; d++) {
                        qd[d] = FROM(qg[d]) * scale;
                        ad[d] = 0.0f;
                    }
                    m[j * group + g] = -INFINITY;
                    l[j * group + g] = 0.0f;
                }
            const T *k_head = k_cache + kh * head_dim, *v_head = v_cache + kh * head_dim;
            const int prefetch = qlen == 1;
            NAME(chunk_rows)(table, lo0, vis_last, block_size, row, head_dim, k_head, v_head,
                             kp[0], vp[0], prefetch);
            for (int64_t start = lo0, i = 0; start < vis_last; start += CHUNK, i ^= 1) {
                const int64_t chunk_len = vis_last - start < CHUNK ? vis_last - start : CHUNK;
                if (start + CHUNK < vis_last)
                    NAME(chunk_rows)(table, start + CHUNK, vis_last, block_size, row, head_dim,
                                     k_head, v_head, kp[i ^ 1], vp[i ^ 1], prefetch);
                for (int64_t j = 0; j < ntok; j++) {
                    const int64_t vis = vis0 + j;
                    /* this token's keys in the chunk: [start + skip, start + skip + len) */
                    const int64_t lo = window > 0 && vis > window ? vis - window : 0;
                    const int64_t skip = lo > start ? lo - start : 0;
                    if (start >= vis || skip >= CHUNK)
                        continue;
                    const int64_t end = vis - start < CHUNK ? vis - start : CHUNK;
                    const int64_t len = end - skip;
                    const T *const *kk = kp[i], *const *vv = vp[i];
                    if (skip > 0 || len < chunk_len) { /* rows past len repeat its last key */
                        for (int64_t t = 0; t < CHUNK; t++) {
                            kpj[t] = kp[i][skip + (t < len ? t : len - 1)];
                            vpj[t] = vp[i][skip + (t < len ? t : len - 1)];
                        }
                        kk = kpj;
                        vv = vpj;
                    }
                    for (int64_t g = 0; g < group; g++)
                        NAME(attend)(qs + j * per_tok + g * head_dim,
                                     acc + j * per_tok + g * head_dim, &m[j * group + g],
                                     &l[j * group + g], kk, vv, len, head_dim, sc);
                }
            }
            for (int64_t j = 0; j < ntok; j++)
                for (int64_t g = 0; g < group; g++) {
                    T *og = out + ((tok0 + j) * num_heads + kh * group + g) * head_dim;
                    const float *ad = acc + j * per_tok + g * head_dim;
                    const float inv = 1.0f / l[j * group + g];
                    for (int64_t d = 0; d < head_dim; d++)
                        og[d] = TO(ad[d] * inv);
                }
        }
        free(qs);
        free(acc);
    }
    free(tile_seq);
    free(tile_tok);
}

/* y = rms_norm(x) * weight, after x += delta when delta is given (the residual add of the
 * previous sublayer, fused so the hidden state is read once). As in transformers, the sum
 * is stored in T and the normalised row is rounded to T before the weight multiplies it. */
void NAME(add_rms_norm)(T *x, const T *delta, const T *weight, T *y, int64_t num_rows,
                        int64_t dim, float eps)
{
#pragma omp parallel for schedule(static) if (num_rows > 16)
    for (int64_t r = 0; r < num_rows; r++) {
        T *xr = x + r * dim;
        T *yr = y + r * dim;
        if (delta) {
            const T *dr = delta + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++)
                xr[d] = TO(FROM(xr[d]) + FROM(dr[d]));
        }
        float sumsq = 0.0f;
#pragma omp simd reduction(+ : sumsq)
        for (int64_t d = 0; d < dim; d++)
            sumsq += FROM(xr[d]) * FROM(xr[d]);
        const float inv = 1.0f / sqrtf(sumsq / (float)dim + eps);
#pragma omp simd
        for (int64_t d = 0; d < dim; d++)
            yr[d] = TO(FROM(weight[d]) * ROUND(FROM(xr[d]) * inv));
    }
}

/* out = silu(gate) * up, where each row of gate_up is [gate | up]. */
void NAME(silu_mul)(const T *gate_up, T *out, int64_t num_rows, int64_t dim)
{
#pragma omp parallel for schedule(static) if (num_rows > 4)
    for (int64_t r = 0; r < num_rows; r++) {
        const T *g = gate_up + r * 2 * dim;
        const T *u = g + dim;
        T *o = out + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) {
            const float gd = FROM(g[d]);
            o[d] = TO(ROUND(gd / (1.0f + fast_expf(-gd))) * FROM(u[d]));
        }
    }
}

/* Rotary embedding in place on the first `num_heads` heads of each row of x (the query and
 * key heads of a fused QKV row), in the rotate-half convention, on each head's first
 * `rotary_dim` dimensions (all of them but for partial rotary); cos and sin are
 * [positions, rotary_dim] tables with each half repeated. */
void NAME(rope)(T *x, int64_t x_stride, const int64_t *positions, const T *cos_table,
                const T *sin_table, int64_t num_rows, int64_t num_heads, int64_t head_dim,
                int64_t rotary_dim)
{
    const int64_t half = rotary_dim / 2;
#pragma omp parallel for schedule(static) if (num_rows > 16)
    for (int64_t r = 0; r < num_rows; r++) {
        const T *c = cos_table + positions[r] * rotary_dim;
        const T *s = sin_table + positions[r] * rotary_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            T *a = x + r * x_stride + h * head_dim;
            T *b = a + half;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float x1 = FROM(a[d]), x2 = FROM(b[d]);
                a[d] = TO(ROUND(x1 * FROM(c[d])) - ROUND(x2 * FROM(s[d])));
                b[d] = TO(ROUND(x2 * FROM(c[half + d])) + ROUND(x1 * FROM(s[half + d])));
            }
        }
    }
}

/* RMS norm in place of each of the first `num_heads` heads of each row of x, with one weight
 * of head_dim for all (Qwen3's and Gemma 3's q/k norms, on the heads of a fused QKV row);
 * rounded as add_rms_norm rounds. */
void NAME(rms_norm_heads)(T *x, int64_t x_stride, int64_t num_rows, int64_t num_heads,
                          int64_t head_dim, const T *weight, float eps)
{
#pragma omp parallel for schedule(static) if (num_rows * num_heads > 64)
    for (int64_t r = 0; r < num_rows; r++)
        for (int64_t h = 0; h < num_heads; h++) {
            T *xh = x + r * x_stride + h * head_dim;
            float sumsq = 0.0f;
#pragma omp simd reduction(+ : sumsq)
            for (int64_t d = 0; d < head_dim; d++)
                sumsq += FROM(xh[d]) * FROM(xh[d]);
            const float inv = 1.0f / sqrtf(sumsq / (float)head_dim + eps);
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++)
                xh[d] = TO(FROM(weight[d]) * ROUND(FROM(xh[d]) * inv));
        }
}

/* out = gelu_tanh(gate) * up, where each row of gate_up is [gate | up] (Gemma's MLP):
 * gelu_tanh(g) = g / 2 * (1 + tanh(u)), u = sqrt(2 / pi) * (g + 0.044715 g^3), computed as
 * g / (1 + e^(-2u)), the same value without the cancellation of 1 + tanh(u) near -1. */
void NAME(gelu_tanh_mul)(const T *gate_up, T *out, int64_t num_rows, int64_t dim)
{
#pragma omp parallel for schedule(static) if (num_rows > 4)
    for (int64_t r = 0; r < num_rows; r++) {
        const T *g = gate_up + r * 2 * dim;
        const T *u = g + dim;
        T *o = out + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) {
            const float gd = FROM(g[d]);
            const float inner = 0.7978845608028654f * (gd + 0.044715f * gd * gd * gd);
            const float gelu = gd / (1.0f + fast_expf(-2.0f * inner));
            o[d] = TO(ROUND(gelu) * FROM(u[d]));
        }
    }
}

/* The index of each row's first maximum (greedy sampling over the vocabulary). torch's
 * max(dim) with indices does not vectorize on the CPU: over 64 rows of 49,152 logits it
 * took ten times a plain max reduction. Here: the maximum in one vectorized pass, then the
 * first block of 64 holding it (a vectorized test per block) and its index within. NaN
 * entries are skipped (torch would return a NaN's index); a row of NaN only gives 0. */
void NAME(argmax_rows)(const T *x, int64_t row_stride, int64_t num_rows, int64_t num_cols,
                       int64_t *out)
{
#pragma omp parallel for schedule(static) if (num_rows > 4)
    for (int64_t r = 0; r < num_rows; r++) {
        const T *row = x + r * row_stride;
        float best = -INFINITY;
#pragma omp simd reduction(max : best)
        for (int64_t c = 0; c < num_cols; c++) {
            const float v = FROM(row[c]);
            best = v > best ? v : best;
        }
        int64_t at = 0;
        for (int64_t c0 = 0; c0 < num_cols; c0 += 64) {
            const int64_t end = c0 + 64 < num_cols ? c0 + 64 : num_cols;
            int hit = 0;
#pragma omp simd reduction(| : hit)
            for (int64_t c = c0; c < end; c++)
                hit |= FROM(row[c]) == best;
            if (hit) {
                at = c0;
                while (FROM(row[at]) != best)
                    at++;
                break;
            }
        }
        out[r] = at;
    }
}
