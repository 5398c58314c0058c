/* CPU kernels for the engine's float32 forward pass.
 *
 * Why C: on a small model the CPU decode step is dominated, after the matrix products, by
 * many small torch ops (each a dispatch plus a pass over memory) and by attention that must
 * first gather the paged K/V into contiguous tensors. These kernels read the paged cache in
 * place and fuse the elementwise work; kernels/cpu_ops.py builds this file with the
 * system C compiler and checks every function against kernels/reference.py in the tests.
 *
 * All tensors are float32 and row-major; the Python side checks shapes and contiguity.
 * Parallel loops use OpenMP, which resolves to the libgomp torch has already loaded, so both
 * share one thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16  /* query heads per KV head */
#define MAX_HEAD_DIM 256
#define CHUNK 64  /* keys scored before they are folded into the running softmax */

/* e^x to within a few float ulps for x in [-87, 88] (clamped outside: e^-87 is 1.6e-38,
 * nothing next to any weight that matters): a branch-free range reduction and polynomial
 * that the compiler vectorizes, unlike libm's expf. */
static inline float fast_expf(float x)
{
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    /* round to nearest by the 1.5 * 2^23 trick: floorf would stop the vectorizer */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Fold scores sc[0..len) into a running softmax (max `m`, denominator `l`): on return
 * sc holds the unnormalised probabilities, and the result is the factor by which the
 * output accumulated so far must be rescaled. */
static inline float softmax_update(float *sc, int64_t len, float *m, float *l)
{
    float chunk_max = -INFINITY;
    for (int64_t t = 0; t < len; t++)
        chunk_max = sc[t] > chunk_max ? sc[t] : chunk_max;
    const float new_max = chunk_max > *m ? chunk_max : *m;
    const float alpha = fast_expf(*m - new_max);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; t++) {
        sc[t] = fast_expf(sc[t] - new_max);
        sum += sc[t];
    }
    *l = *l * alpha + sum;
    *m = new_max;
    return alpha;
}

/* Fold the keys kp[0..len) and values vp[0..len) into one query head's state: `m`, `l` and
 * the unnormalised output `acc`. Portable C; the AVX2 version below is the fast path. */
static inline void attend_generic(const float *qg, float *acc, float *m, float *l,
                                  const float *const *kp, const float *const *vp, int64_t len,
                                  int64_t head_dim, float *sc)
{
    for (int64_t t = 0; t < len; t++) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; d++)
            dot += qg[d] * kp[t][d];
        sc[t] = dot;
    }
    const float alpha = softmax_update(sc, len, m, l);
    for (int64_t d = 0; d < head_dim; d++)
        acc[d] *= alpha;
    for (int64_t t = 0; t < len; t++) {
        const float p = sc[t];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++)
            acc[d] += p * vp[t][d];
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The eight lane sums of p[0..7], as one vector: the horizontal reductions of eight dot
 * products shared in one add tree instead of done one by one. */
static inline __m256 sum8(const __m256 *p)
{
    const __m256 s01 = _mm256_hadd_ps(p[0], p[1]), s23 = _mm256_hadd_ps(p[2], p[3]);
    const __m256 s45 = _mm256_hadd_ps(p[4], p[5]), s67 = _mm256_hadd_ps(p[6], p[7]);
    const __m256 lo = _mm256_hadd_ps(s01, s23), hi = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                         _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* attend_generic for head sizes that are multiples of 8. Eight keys are scored at once with
 * eight independent accumulators (one dot product alone would wait on its own chain of
 * fused multiply-adds), and the output stays in registers across the chunk. `kp` must
 * have a multiple of 8 entries, the padding pointing at any valid key. Inlined per head
 * size so that the inner loops have constant bounds. */
static inline __attribute__((always_inline)) void
attend_avx2(const float *qg, float *acc, float *m, float *l, const float *const *kp,
            const float *const *vp, int64_t len, const int64_t head_dim, float *sc)
{
    const int64_t nc = head_dim / 8;
    for (int64_t t0 = 0; t0 < len; t0 += 8) {
        __m256 part[8];
        for (int64_t j = 0; j < 8; j++)
            part[j] = _mm256_setzero_ps();
        for (int64_t c = 0; c < nc; c++) {
            const __m256 qv = _mm256_loadu_ps(qg + 8 * c);
            for (int64_t j = 0; j < 8; j++)
                part[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[t0 + j] + 8 * c), part[j]);
        }
        _mm256_storeu_ps(sc + t0, sum8(part));
    }
    const __m256 alpha = _mm256_set1_ps(softmax_update(sc, len, m, l));
    for (int64_t c0 = 0; c0 < nc; c0 += 8) {
        const int64_t cb = nc - c0 < 8 ? nc - c0 : 8;
        __m256 r[8];
        for (int64_t c = 0; c < cb; c++)
            r[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * (c0 + c)), alpha);
        for (int64_t t = 0; t < len; t++) {
            const __m256 p = _mm256_set1_ps(sc[t]);
            for (int64_t c = 0; c < cb; c++)
                r[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vp[t] + 8 * (c0 + c)), r[c]);
        }
        for (int64_t c = 0; c < cb; c++)
            _mm256_storeu_ps(acc + 8 * (c0 + c), r[c]);
    }
}
#endif

/* One query head's chunk, by the fastest path the head size allows. */
static inline void attend(const float *qg, float *acc, float *m, float *l,
                          const float *const *kp, const float *const *vp, int64_t len,
                          int64_t head_dim, float *sc)
{
#if defined(__AVX2__) && defined(__FMA__)
    if (head_dim == 64)
        attend_avx2(qg, acc, m, l, kp, vp, len, 64, sc);
    else if (head_dim == 128)
        attend_avx2(qg, acc, m, l, kp, vp, len, 128, sc);
    else if (head_dim % 8 == 0)
        attend_avx2(qg, acc, m, l, kp, vp, len, head_dim, sc);
    else
#endif
        attend_generic(qg, acc, m, l, kp, vp, len, head_dim, sc);
}

/* Causal attention of new query tokens over a paged K/V cache.
 *
 * Same semantics as kernels.reference.paged_attention_torch, for decodes and prefill chunks
 * alike. Work items are (query token, KV head); each walks the token's visible keys CHUNK at
 * a time (whatever the block size) with an online softmax, for all query heads of its KV
 * head, so each K/V row comes from memory once per token. Measured here about twice as fast
 * as SDPA on prefill chunks too, gathers included, so one kernel serves the whole batch.
 */
void paged_attention_f32(
    const float *q, int64_t q_stride, float *out, const float *k_cache,
    const float *v_cache, const int32_t *cu_seqlens_q, const int32_t *seq_lens,
    const int32_t *block_tables, int64_t max_blocks, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale)
{
    const int64_t num_items = cu_seqlens_q[num_seqs];
    int32_t *item_seq = malloc(sizeof(int32_t) * (num_items ? num_items : 1));
    for (int32_t s = 0; s < num_seqs; s++)
        for (int32_t t = cu_seqlens_q[s]; t < cu_seqlens_q[s + 1]; t++)
            item_seq[t] = s;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* floats per cached token */

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t w = 0; w < num_items * num_kv_heads; w++) {
        const int32_t s = item_seq[w / num_kv_heads];
        const int64_t tok = w / num_kv_heads;
        const int64_t kh = w % num_kv_heads;
        const int32_t qlen = cu_seqlens_q[s + 1] - cu_seqlens_q[s];
        const int64_t visible = seq_lens[s] - qlen + (tok - cu_seqlens_q[s]) + 1;
        const int32_t *table = block_tables + (int64_t)s * max_blocks;

        float qs[MAX_GROUP * MAX_HEAD_DIM], acc[MAX_GROUP * MAX_HEAD_DIM];
        float m[MAX_GROUP], l[MAX_GROUP], sc[CHUNK];
        const float *kp[CHUNK], *vp[CHUNK];
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + tok * q_stride + (kh * group + g) * head_dim;
            for (int64_t d = 0; d < head_dim; d++) {
                qs[g * head_dim + d] = qg[d] * scale;
                acc[g * head_dim + d] = 0.0f;
            }
            m[g] = -INFINITY;
            l[g] = 0.0f;
        }
        for (int64_t start = 0; start < visible; start += CHUNK) {
            const int64_t len = visible - start < CHUNK ? visible - start : CHUNK;
            int64_t b = start / block_size, off = start % block_size;
            for (int64_t t = 0; t < CHUNK; t++) {
                /* rows past len repeat the last key: padding for the 8-wide scoring */
                const int64_t slot = (int64_t)table[b] * block_size + off;
                kp[t] = k_cache + slot * row + kh * head_dim;
                vp[t] = v_cache + slot * row + kh * head_dim;
                if (t + 1 < len && ++off == block_size) {
                    off = 0;
                    b++;
                }
            }
            for (int64_t g = 0; g < group; g++)
                attend(qs + g * head_dim, acc + g * head_dim, &m[g], &l[g], kp, vp, len,
                       head_dim, sc);
        }
        for (int64_t g = 0; g < group; g++) {
            float *og = out + (tok * num_heads + kh * group + g) * head_dim;
            const float inv = 1.0f / l[g];
            for (int64_t d = 0; d < head_dim; d++)
                og[d] = acc[g * head_dim + d] * inv;
        }
    }
    free(item_seq);
}

/* y = rms_norm(x) * weight, after x += delta when delta is given (the residual add of the
 * previous sublayer, fused so the hidden state is read once). */
void add_rms_norm_f32(float *x, const float *delta, const float *weight, float *y,
                      int64_t num_rows, int64_t dim, float eps)
{
#pragma omp parallel for schedule(static) if (num_rows > 16)
    for (int64_t r = 0; r < num_rows; r++) {
        float *xr = x + r * dim;
        float *yr = y + r * dim;
        if (delta) {
            const float *dr = delta + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++)
                xr[d] += dr[d];
        }
        float sumsq = 0.0f;
#pragma omp simd reduction(+ : sumsq)
        for (int64_t d = 0; d < dim; d++)
            sumsq += xr[d] * xr[d];
        const float inv = 1.0f / sqrtf(sumsq / (float)dim + eps);
#pragma omp simd
        for (int64_t d = 0; d < dim; d++)
            yr[d] = weight[d] * (xr[d] * inv);
    }
}

/* out = silu(gate) * up, where each row of gate_up is [gate | up]. */
void silu_mul_f32(const float *gate_up, float *out, int64_t num_rows, int64_t dim)
{
#pragma omp parallel for schedule(static) if (num_rows > 4)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *g = gate_up + r * 2 * dim;
        const float *u = g + dim;
        float *o = out + r * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; d++)
            o[d] = g[d] / (1.0f + fast_expf(-g[d])) * u[d];
    }
}

/* Rotary embedding in place on the first `num_heads` heads of each row of x (the query and
 * key heads of a fused QKV row), in the rotate-half convention; cos and sin are
 * [max_positions, head_dim] tables with each half repeated. */
void rope_f32(float *x, int64_t x_stride, const int64_t *positions, const float *cos_table,
              const float *sin_table, int64_t num_rows, int64_t num_heads, int64_t head_dim)
{
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (num_rows > 16)
    for (int64_t r = 0; r < num_rows; r++) {
        const float *c = cos_table + positions[r] * head_dim;
        const float *s = sin_table + positions[r] * head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            float *a = x + r * x_stride + h * head_dim;
            float *b = a + half;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float x1 = a[d], x2 = b[d];
                a[d] = x1 * c[d] - x2 * s[d];
                b[d] = x2 * c[half + d] + x1 * s[half + d];
            }
        }
    }
}
