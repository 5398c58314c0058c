/* CPU kernels for the engine's float32 and bfloat16 forward passes.
 *
 * Why C: on a small model the CPU decode step is dominated, after the matrix products, by
 * many small torch ops (each a dispatch plus a pass over memory) and by attention that must
 * first gather the paged K/V into contiguous tensors. These kernels read the paged cache in
 * place and fuse the elementwise work; kernels/cpu_ops.py builds this file with the
 * system C compiler and checks every function against kernels/reference.py in the tests.
 *
 * The kernels themselves are in cpu_ops_typed.h, instantiated below for float (`_f32`) and
 * for bfloat16 (`_bf16`: storage only, every sum and product in float32). All tensors are
 * row-major; the Python side checks dtypes, shapes and contiguity.
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
#define QTILE 8   /* query tokens of one sequence that share each chunk of K/V rows */

/* e^x to within a few float ulps for x in [-87, 88] (clamped outside: e^-87 is 1.6e-38,
 * nothing next to any weight that matters): a branch-free range reduction and polynomial
 * that the compiler vectorizes, unlike libm's expf (with -fno-thread-jumps: see cpu_ops.py). */
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

/* The largest of sc[0..len), NaNs ignored. A plain loop: gcc does not vectorize this
 * reduction without -ffast-math, so the AVX2 path keeps its own maximum while scoring. */
static inline float scores_max(const float *sc, int64_t len)
{
    float chunk_max = -INFINITY;
    for (int64_t t = 0; t < len; t++)
        chunk_max = sc[t] > chunk_max ? sc[t] : chunk_max;
    return chunk_max;
}

/* Fold scores sc[0..len), whose largest is `chunk_max`, into a running softmax (max `m`,
 * denominator `l`): on return sc holds the unnormalised probabilities, and the result is
 * the factor by which the output accumulated so far must be rescaled. */
static inline float softmax_update(float *sc, int64_t len, float chunk_max, float *m, float *l)
{
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

/* The largest lane of v, which holds no NaN (the caller's maximum never takes one). */
static inline float hmax8(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    m = _mm_max_ps(_mm_movehl_ps(m, m), m);
    m = _mm_max_ss(_mm_movehdup_ps(m), m);
    return _mm_cvtss_f32(m);
}

#endif

/* bfloat16 is the top half of a float32: widening is a 16-bit shift, narrowing rounds to
 * nearest even (NaN kept a quiet NaN, as torch does). Plain integer code that gcc
 * vectorizes; no bf16 instructions needed. */
typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? (bf16_t)0x7fc0u : (bf16_t)rounded;
}

#define T float
#define NAME(f) f##_f32
#define FROM(v) (v)
#define TO(v) (v)
#define ROUND(v) (v)
#define LOAD8(p) _mm256_loadu_ps(p)
#include "cpu_ops_typed.h"
#undef T
#undef NAME
#undef FROM
#undef TO
#undef ROUND
#undef LOAD8

#define T bf16_t
#define NAME(f) f##_bf16
#define FROM(v) bf16_to_f32(v)
#define TO(v) f32_to_bf16(v)
#define ROUND(v) bf16_to_f32(f32_to_bf16(v))
#define LOAD8(p)                                                                                \
    _mm256_castsi256_ps(                                                                        \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#include "cpu_ops_typed.h"

#include "cpu_quant.h"
