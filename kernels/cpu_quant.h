/* Matrix products on quantized weights: GGUF's Q8_0, Q4_0 and Q4_1 blocks kept as the file
 * holds them, activations quantized per block of 32 to int8 (as llama.cpp's Q8_0), and
 * int8 dot products summed per block then scaled in float32. Included by cpu_ops.c, on x86
 * with AVX2 only; kernels/cpu_quant.py checks shapes and picks the instruction set.
 *
 * Q4_0 and Q4_1 store nibbles 0..15: the dot product takes them unsigned as they are, and
 * the block's offset (-8 d for Q4_0, m for Q4_1) comes back as offset * d_x * sum(q_x).
 * Q8_0's signed weights go in as |w| with x given w's sign, so u8 x s8 works for all three.
 */
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#define QK 32      /* values per block, weights and activations alike */
#define MT 4       /* activation rows sharing each unpacked weight block */
#define NR 2       /* weight rows sharing each loaded activation block */
#define NCHUNK 16  /* weight rows per thread's work item */

/* gguf.GGMLQuantizationType values */
#define QTYPE_Q4_0 2
#define QTYPE_Q4_1 3
#define QTYPE_Q8_0 8

static inline size_t block_bytes(int qtype)
{
    return qtype == QTYPE_Q8_0 ? 34 : qtype == QTYPE_Q4_1 ? 20 : 18;
}

static inline float fp16_to_f32(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define ISA_ATTR __attribute__((target("avx2,fma,f16c")))
#define ISA(f) f##_avx2
#define DOT_U8S8(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
#include "cpu_quant_isa.h"
#undef ISA_ATTR
#undef ISA
#undef DOT_U8S8

#define ISA_ATTR __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#define ISA(f) f##_vnni
#define DOT_U8S8(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
#include "cpu_quant_isa.h"
#undef ISA_ATTR
#undef ISA
#undef DOT_U8S8

/* out[m, n] = x[m, k] . dequant(w)[n, k]; `vnni` picks vpdpbusd (the caller has checked the
 * CPU has it). Returns -1 where the scratch for the quantized activations cannot be had. */
int quant_matmul_f32(int qtype, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m,
                     float *out, int vnni)
{
    const int64_t nb = k / QK;
    int8_t *xq = malloc((size_t)(m * k));
    float *xd = malloc(sizeof(float) * (size_t)(2 * m * nb));
    if (xq == NULL || xd == NULL) {
        free(xq);
        free(xd);
        return -1;
    }
    float *xs = xd + m * nb;
    if (vnni) {
        quantize_rows_vnni(x, m, k, xq, xd, xs);
        quant_matmul_vnni(qtype, w, n, k, xq, xd, xs, m, out);
    } else {
        quantize_rows_avx2(x, m, k, xq, xd, xs);
        quant_matmul_avx2(qtype, w, n, k, xq, xd, xs, m, out);
    }
    free(xq);
    free(xd);
    return 0;
}

/* Rows ids[0..count) of w dequantized into out [count, k]: the embedding lookup. */
void dequant_rows_f32(int qtype, const uint8_t *w, int64_t k, const int64_t *ids, int64_t count,
                      float *out)
{
    const int64_t nb = k / QK, bytes = (int64_t)block_bytes(qtype);
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w + ids[i] * nb * bytes;
        float *dst = out + i * k;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bytes;
            const float d = fp16_to_f32(blk);
            if (qtype == QTYPE_Q8_0) {
                for (int j = 0; j < QK; j++)
                    dst[b * QK + j] = d * (float)(int8_t)blk[2 + j];
                continue;
            }
            const uint8_t *qs = blk + (qtype == QTYPE_Q4_1 ? 4 : 2);
            const float offset = qtype == QTYPE_Q4_1 ? fp16_to_f32(blk + 2) : -8.0f * d;
            for (int j = 0; j < QK / 2; j++) {
                dst[b * QK + j] = d * (float)(qs[j] & 0x0f) + offset;
                dst[b * QK + j + QK / 2] = d * (float)(qs[j] >> 4) + offset;
            }
        }
    }
}

#endif
