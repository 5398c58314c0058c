/* Matrix products on quantized weights: GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and
 * Q6_K blocks kept as the file holds them. For a few activation rows, activations quantized
 * per block of 32 to int16, and int16 dot products summed per block then scaled in float32;
 * for more, the weights decoded to float32 by tiles (float_matmul) or whole (dequantize_f32,
 * under torch's product). Included by cpu_ops.c, on x86 with AVX2 only; kernels/cpu_quant.py
 * checks shapes and picks the product and the instruction set.
 *
 * Int16 activations rather than llama.cpp's int8: the default model's top-1 agreement with
 * float32 rose from 0.957 to the 0.98 bar only with the finer rounding (docs/performance.md).
 * Every format is read as blocks of 32 values w = scale * q + offset, q an int16: the
 * K-quants' 256-value super-blocks give eight such blocks (their sub-block scale and minimum
 * folded into scale and offset; Q6_K's two 16-value scales folded into q). The offset
 * comes back as offset * d_x * sum(q_x) per block.
 */
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

#define QK 32      /* values per block, weights and activations alike */
#define QK_K 256   /* values per K-quant super-block */
#define MT 4       /* activation rows sharing each unpacked weight block */
#define NR 2       /* weight rows sharing each loaded activation block */
#define NCHUNK 16  /* weight rows per thread's work item */
#define KB 128     /* values of k per decoded block of the float-tile product */

/* gguf.GGMLQuantizationType values */
#define QTYPE_Q4_0 2
#define QTYPE_Q4_1 3
#define QTYPE_Q5_0 6
#define QTYPE_Q5_1 7
#define QTYPE_Q8_0 8
#define QTYPE_Q4_K 12
#define QTYPE_Q5_K 13
#define QTYPE_Q6_K 14
/* Internal: blocks decoded once for many activation tiles, 32 int16 q, a float scale and a
 * float offset each (cpu_quant_isa.h: decode). */
#define QTYPE_DECODED (-1)
#define DECODED_BYTES 72

/* Bytes of one stored block (a super-block for the K-quants). */
static inline int64_t block_bytes(int qtype)
{
    switch (qtype) {
    case QTYPE_Q4_0: return 18;
    case QTYPE_Q4_1: return 20;
    case QTYPE_Q5_0: return 22;
    case QTYPE_Q5_1: return 24;
    case QTYPE_Q8_0: return 34;
    case QTYPE_Q4_K: return 144;
    case QTYPE_Q5_K: return 176;
    case QTYPE_Q6_K: return 210;
    default: return DECODED_BYTES;
    }
}

static inline int is_k_quant(int qtype)
{
    return qtype == QTYPE_Q4_K || qtype == QTYPE_Q5_K || qtype == QTYPE_Q6_K;
}

static inline int64_t row_bytes_of(int qtype, int64_t k)
{
    return k / (is_k_quant(qtype) ? QK_K : QK) * block_bytes(qtype);
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

/* The 6-bit scale and minimum of sub-block j of a Q4_K/Q5_K super-block's 12 scale bytes. */
static inline void k_scale_min(int j, const uint8_t *s, int *scale, int *min)
{
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Block b of a row, one value at a time: w[j] = scale * q[j] + offset. The reference the
 * vector decoders of cpu_quant_isa.h follow, and the embedding lookup's decoder. */
static void decode_block(int qtype, const uint8_t *row, int64_t b, int16_t q[QK], float *scale,
                         float *offset)
{
    *offset = 0.0f;
    if (qtype == QTYPE_Q8_0) {
        const uint8_t *blk = row + b * 34;
        *scale = fp16_to_f32(blk);
        for (int j = 0; j < QK; j++)
            q[j] = (int8_t)blk[2 + j];
        return;
    }
    if (qtype == QTYPE_Q4_0 || qtype == QTYPE_Q4_1 || qtype == QTYPE_Q5_0 || qtype == QTYPE_Q5_1) {
        const uint8_t *blk = row + b * block_bytes(qtype);
        const int has_min = qtype == QTYPE_Q4_1 || qtype == QTYPE_Q5_1;
        const int five = qtype == QTYPE_Q5_0 || qtype == QTYPE_Q5_1;
        uint32_t qh = 0;
        if (five)
            memcpy(&qh, blk + (has_min ? 4 : 2), sizeof qh);
        const uint8_t *qs = blk + (has_min ? 4 : 2) + (five ? 4 : 0);
        const int bias = has_min ? 0 : five ? 16 : 8;
        *scale = fp16_to_f32(blk);
        if (has_min)
            *offset = fp16_to_f32(blk + 2);
        for (int j = 0; j < QK / 2; j++) {
            q[j] = (int16_t)(((qs[j] & 0x0f) | (((qh >> j) & 1) << 4)) - bias);
            q[j + QK / 2] = (int16_t)(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - bias);
        }
        return;
    }
    const int j = (int)(b % 8); /* the K-quants: sub-block j of super-block b / 8 */
    const uint8_t *sb = row + b / 8 * block_bytes(qtype);
    if (qtype == QTYPE_Q6_K) {
        const int n = j / 4, t = j % 4;
        const uint8_t *ql = sb + 64 * n + 32 * (t & 1), *qh = sb + 128 + 32 * n;
        const int8_t *sc = (const int8_t *)(sb + 192) + 8 * n + 2 * t;
        *scale = fp16_to_f32(sb + 208);
        for (int l = 0; l < QK; l++) {
            const int v = ((ql[l] >> (4 * (t >> 1))) & 0x0f) | (((qh[l] >> (2 * t)) & 3) << 4);
            q[l] = (int16_t)((v - 32) * sc[l / 16]);
        }
        return;
    }
    int sc, mn;
    k_scale_min(j, sb + 4, &sc, &mn);
    *scale = fp16_to_f32(sb) * (float)sc;
    *offset = -(fp16_to_f32(sb + 2) * (float)mn);
    const int five = qtype == QTYPE_Q5_K;
    const uint8_t *qs = sb + (five ? 48 : 16) + 32 * (j / 2), *qh = sb + 16;
    for (int l = 0; l < QK; l++)
        q[l] = (int16_t)(((qs[l] >> (4 * (j & 1))) & 0x0f) | (five ? ((qh[l] >> j) & 1) << 4 : 0));
}

/* CALL(q) with q the constant of qtype's format: each call site's kernel is inlined and
 * specialised per format (a variable qtype would test it in every block's decode). */
#define BY_FORMAT(qtype, CALL)                                                                \
    switch (qtype) {                                                                          \
    case QTYPE_Q8_0: CALL(QTYPE_Q8_0); break;                                                 \
    case QTYPE_Q4_0: CALL(QTYPE_Q4_0); break;                                                 \
    case QTYPE_Q4_1: CALL(QTYPE_Q4_1); break;                                                 \
    case QTYPE_Q5_0: CALL(QTYPE_Q5_0); break;                                                 \
    case QTYPE_Q5_1: CALL(QTYPE_Q5_1); break;                                                 \
    case QTYPE_Q4_K: CALL(QTYPE_Q4_K); break;                                                 \
    case QTYPE_Q5_K: CALL(QTYPE_Q5_K); break;                                                 \
    default: CALL(QTYPE_Q6_K);                                                                \
    }

#define ISA_ATTR __attribute__((target("avx2,fma,f16c")))
#define ISA(f) f##_avx2
/* the eight int32 sums of four adjacent int16 products: a . b over 16 values, c . d over 16 */
#define DOT2_S16(a, b, c, d) _mm256_add_epi32(_mm256_madd_epi16(a, b), _mm256_madd_epi16(c, d))
/* float32 vectors of the float tiles: 8 lanes, 6 weight rows x 2 accumulators of 16 registers */
#define FLANES 8
#define FNW 6
#define FVEC __m256
#define FLOAD _mm256_loadu_ps
#define FSTORE _mm256_storeu_ps
#define FSET1 _mm256_set1_ps
#define FFMA _mm256_fmadd_ps
#define FZERO _mm256_setzero_ps
#include "cpu_quant_isa.h"

#define ISA_ATTR __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#define ISA(f) f##_vnni
#define DOT2_S16(a, b, c, d) _mm256_dpwssd_epi32(_mm256_madd_epi16(a, b), c, d)
/* 16 lanes, 12 weight rows x 2 accumulators of 32 registers */
#define FLANES 16
#define FNW 12
#define FVEC __m512
#define FLOAD _mm512_loadu_ps
#define FSTORE _mm512_storeu_ps
#define FSET1 _mm512_set1_ps
#define FFMA _mm512_fmadd_ps
#define FZERO _mm512_setzero_ps
#include "cpu_quant_isa.h"

/* out[m, n] = x[m, k] . dequant(w)[n, k], out's rows ldo apart (a column slice of a wider
 * output); `vnni` picks the AVX-512 kernels (the caller has checked the CPU has them), and
 * `float_tiles` the float-tile product over the int16 one. Returns -1 where a buffer cannot
 * be had. */
int quant_matmul_f32(int qtype, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m,
                     float *out, int64_t ldo, int vnni, int float_tiles)
{
    if (float_tiles)
        return vnni ? float_matmul_vnni(qtype, w, n, k, x, m, out, ldo)
                    : float_matmul_avx2(qtype, w, n, k, x, m, out, ldo);
    const int64_t nb = k / QK;
    int16_t *xq = malloc(sizeof(int16_t) * (size_t)(m * k));
    float *xd = malloc(sizeof(float) * (size_t)(2 * m * nb));
    if (xq == NULL || xd == NULL) {
        free(xq);
        free(xd);
        return -1;
    }
    float *xs = xd + m * nb;
    if (vnni)
        quant_matmul_vnni(qtype, w, n, k, x, m, xq, xd, xs, out, ldo);
    else
        quant_matmul_avx2(qtype, w, n, k, x, m, xq, xd, xs, out, ldo);
    free(xq);
    free(xd);
    return 0;
}

/* All n rows of w dequantized into out [n, k], in parallel. */
void dequantize_f32(int qtype, const uint8_t *w, int64_t n, int64_t k, float *out, int vnni)
{
    if (vnni)
        dequantize_vnni(qtype, w, n, k, out);
    else
        dequantize_avx2(qtype, w, n, k, out);
}

/* Rows ids[0..count) of w dequantized into out [count, k]: the embedding lookup. */
void dequant_rows_f32(int qtype, const uint8_t *w, int64_t k, const int64_t *ids, int64_t count,
                      float *out)
{
    const int64_t nb = k / QK, row_bytes = row_bytes_of(qtype, k);
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w + ids[i] * row_bytes;
        float *dst = out + i * k;
        for (int64_t b = 0; b < nb; b++) {
            int16_t q[QK];
            float scale, offset;
            decode_block(qtype, row, b, q, &scale, &offset);
            for (int j = 0; j < QK; j++)
                dst[b * QK + j] = scale * (float)q[j] + offset;
        }
    }
}

#endif
