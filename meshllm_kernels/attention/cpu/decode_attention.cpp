// Paged decode attention for CPU workers, reading the KV cache in place.
//
// One call per layer and step: writes the step's K/V rows into their cache slots, then, for
// each of the first `num_decodes` rows (one query token each), attends over that sequence's
// keys through its block table. Grouped-query: the query heads sharing a KV head are computed
// together, so each K/V row is read once per (sequence, KV head). fp32 accumulation.
//
// The gather + SDPA path it replaces (services/worker/attention/reference.py) spends a decode layer mostly
// on op dispatch and copies at the sizes a CPU serves (a few sequences, a few hundred keys).
//
// Layout (services/worker/runner/kv_cache.py): cache [2, num_blocks, block_size, kv_heads, head_dim],
// K at index 0 and V at 1; key position p of a sequence lives in slot
// table[p / block_size] * block_size + p % block_size. Rows of q, k, v and out are `*_stride`
// elements apart, with the heads of a row contiguous. head_dim must be a multiple of 16, at most
// 128.
//
// Vectors are GCC vector extensions: 16 floats (an AVX-512 register) where the CPU has AVX-512,
// else 8 (one AVX2 register). 16-float vectors on AVX2 become register pairs that GCC builds
// twice as slowly and runs 1.6-3.6x slower (bench/RESULTS.md, session 33). Built at worker start
// by meshllm_kernels/attention/cpu_decode.py (no torch headers; loaded with ctypes).
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

// -DMESHLLM_VECTOR_WIDTH=8|16 builds the other width (tests build both on every machine).
#if !defined(MESHLLM_VECTOR_WIDTH)
#if defined(__AVX512F__)
#define MESHLLM_VECTOR_WIDTH 16
#else
#define MESHLLM_VECTOR_WIDTH 8  // AVX2 and narrower: GCC builds 16-float vectors there slowly
#endif
#endif
constexpr int64_t kWidth = MESHLLM_VECTOR_WIDTH;
static_assert(kWidth == 8 || kWidth == 16, "MESHLLM_VECTOR_WIDTH is 8 or 16");
typedef float Floats __attribute__((vector_size(kWidth * 4)));
typedef int32_t Ints __attribute__((vector_size(kWidth * 4)));
typedef uint32_t Words __attribute__((vector_size(kWidth * 4)));
typedef uint16_t Halves __attribute__((vector_size(kWidth * 2)));

// bfloat16 values are held as their bits (uint16_t): the upper half of a float.
inline Floats load(const float* p) {
    Floats v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline Floats load(const uint16_t* p) {
    Halves h;
    std::memcpy(&h, p, sizeof h);
    Words w = __builtin_convertvector(h, Words) << 16;
    Floats v;
    std::memcpy(&v, &w, sizeof v);
    return v;
}

inline void store(float* p, Floats v) { std::memcpy(p, &v, sizeof v); }

inline void store(uint16_t* p, Floats v) {
    Words bits;
    std::memcpy(&bits, &v, sizeof bits);
    const Words nan = (bits & 0x7fffffffu) > 0x7f800000u;  // all ones where NaN
    const Words rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;  // nearest even
    const Words quiet = (bits >> 16) | 0x40u;
    const Halves h = __builtin_convertvector((rounded & ~nan) | (quiet & nan), Halves);
    std::memcpy(p, &h, sizeof h);
}

typedef float Floats8 __attribute__((vector_size(32)));
typedef float Floats4 __attribute__((vector_size(16)));

#if MESHLLM_VECTOR_WIDTH == 16
// A tree of halvings (4 shuffle + add steps), not 16 dependent scalar adds.
inline float horizontal_sum(Floats v) {
    const Floats8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                      __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const Floats4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) +
                      __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

// The sums of four vectors at once, [sum(a), sum(b), sum(c), sum(d)]: 10 shuffles and 5 adds,
// where four horizontal_sum calls take 16 shuffles and 20 adds.
inline Floats4 horizontal_sums(Floats a, Floats b, Floats c, Floats d) {
    const Floats ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                              22, 23) +
                      __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                              28, 29, 30, 31);
    const Floats cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                              22, 23) +
                      __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,
                                              28, 29, 30, 31);
    // 4 lanes each of a, b, c, d
    const Floats e = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24,
                                             25, 26, 27) +
                     __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                                             29, 30, 31);
    const Floats8 f = __builtin_shufflevector(e, e, 0, 1, 4, 5, 8, 9, 12, 13) +
                      __builtin_shufflevector(e, e, 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(f, f, 0, 2, 4, 6) + __builtin_shufflevector(f, f, 1, 3, 5, 7);
}
#else
inline float horizontal_sum(Floats v) {
    const Floats4 b = __builtin_shufflevector(v, v, 0, 1, 2, 3) +
                      __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

// [sum(a), sum(b), sum(c), sum(d)] in 6 shuffles and 3 adds.
inline Floats4 horizontal_sums(Floats a, Floats b, Floats c, Floats d) {
    const Floats ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                      __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
    const Floats cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
                      __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
    // 2 lanes each of a, b, c, d
    const Floats e = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
                     __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(e, e, 0, 2, 4, 6) + __builtin_shufflevector(e, e, 1, 3, 5, 7);
}
#endif

// e^x for x <= 0 (scores minus their maximum), Cephes' expf polynomial: within 2 ulp of
// std::exp down to -87, 0 below.
inline Floats exp_nonpositive(Floats x) {
    const Floats tiny = x < -87.0f ? Floats{} + 0.0f : Floats{} + 1.0f;
    x = x < -87.0f ? Floats{} - 87.0f : x;
    const Floats n = __builtin_convertvector(
        __builtin_convertvector(x * 1.44269504088896341f + (x < 0 ? -0.5f : 0.5f), Ints), Floats);
    const Floats r = x - n * 0.693359375f + n * 2.12194440e-4f;
    Floats p = Floats{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const Floats y = p * r * r + r + 1.0f;
    const Ints exponent = (__builtin_convertvector(n, Ints) + 127) << 23;
    Floats scale;
    std::memcpy(&scale, &exponent, sizeof scale);
    return y * scale * tiny;
}

struct Shape {
    int64_t num_blocks, block_size, heads, kv_heads, head_dim;
};

constexpr int kPer16 = 16 / kWidth;  // vectors per 16 floats of head_dim
constexpr int kMaxGroup = 4;   // query heads computed together; larger groups go 4 at a time

// In place: each of `rows` rows of scores (len valid of `padded`) -> softmax probabilities
// (the padding becomes 0).
inline void softmax_rows(float* scores, int rows, int64_t len, int64_t padded) {
    for (int g = 0; g < rows; g++) {
        float* sg = scores + g * padded;
        for (int64_t t = len; t < padded; t++) sg[t] = -INFINITY;
        Floats top = Floats{} - INFINITY;
        for (int64_t t = 0; t < padded; t += kWidth) {
            const Floats v = load(sg + t);
            top = v > top ? v : top;
        }
        float m = top[0];
        for (int64_t i = 1; i < kWidth; i++) m = top[i] > m ? top[i] : m;
        Floats total{};
        for (int64_t t = 0; t < padded; t += kWidth) {
            const Floats e = exp_nonpositive(load(sg + t) - m);
            store(sg + t, e);
            total += e;
        }
        const float inv = 1.0f / horizontal_sum(total);
        for (int64_t t = 0; t < padded; t += kWidth) store(sg + t, load(sg + t) * inv);
    }
}

// Calls visit(start, block, count) for each block of a sequence's `len` key positions: `start`
// the first position in it, `block` pointing at KV head `head` of that position in `cache` (K or
// V), `count` the positions it holds.
template <typename T, typename Visit>
inline void for_each_block(const T* cache, const int64_t* table, int64_t len, const Shape& s,
                           int64_t head, Visit visit) {
    const int64_t row = s.kv_heads * s.head_dim;
    for (int64_t start = 0, b = 0; start < len; start += s.block_size, b++) {
        const int64_t count = len - start < s.block_size ? len - start : s.block_size;
        visit(start, cache + table[b] * s.block_size * row + head * s.head_dim, count);
    }
}

// Scores of R consecutive keys (rows `row` elements apart) for each query head: R = 4 shares one
// reduction among the four dot products of a head, R = 1 is one horizontal sum.
template <typename T, int C, int G, int R>
inline void score_keys(const Floats (&query)[G][C], const T* keys, int64_t row, float* scores,
                       int64_t padded) {
    static_assert(R == 1 || R == 4);
    Floats key[R][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) key[r][c] = load(keys + r * row + c * kWidth);
    for (int g = 0; g < G; g++) {
        Floats dot[R];
        for (int r = 0; r < R; r++) {
            dot[r] = query[g][0] * key[r][0];
            for (int c = 1; c < C; c++) dot[r] += query[g][c] * key[r][c];
        }
        if constexpr (R == 4) {
            const Floats4 sums = horizontal_sums(dot[0], dot[1], dot[2], dot[3]);
            std::memcpy(scores + g * padded, &sums, sizeof sums);
        } else {
            scores[g * padded] = horizontal_sum(dot[0]);
        }
    }
}

// acc[g] += p[g][r] * value row r for R consecutive value rows, row by row (the one-row order).
template <typename T, int C, int G, int R>
inline void accumulate_values(const T* values, int64_t row, const float* probs, int64_t padded,
                              Floats (&acc)[G][C]) {
    Floats value[R][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) value[r][c] = load(values + r * row + c * kWidth);
    for (int g = 0; g < G; g++)
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) acc[g][c] += probs[g * padded + r] * value[r][c];
}

// Query heads q[0..G) sharing KV head `head` of one sequence: out[g] = softmax(q_g . K) V.
// G and C (head_dim / kWidth) are compile-time, so queries, K/V rows and accumulators stay in
// registers. `scores` holds G * padded floats, `padded` = len rounded up to kWidth. Both passes
// take four rows of a block at a time where it has four left (more loads in flight; the value
// pass only while its rows and the accumulators fit the registers, head_dim <= 64), then one.
template <typename T, int C, int G>
void attend_group(const T* q, const T* cache_k, const T* cache_v, const int64_t* table,
                  int64_t len, const Shape& s, int64_t head, float scale, float* scores,
                  int64_t padded, T* out) {
    Floats query[G][C];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) query[g][c] = load(q + g * s.head_dim + c * kWidth) * scale;
    const int64_t row = s.kv_heads * s.head_dim;
    for_each_block(cache_k, table, len, s, head, [&](int64_t start, const T* block, int64_t count) {
        int64_t j = 0;
        for (; j + 4 <= count; j += 4)
            score_keys<T, C, G, 4>(query, block + j * row, row, scores + start + j, padded);
        for (; j < count; j++)
            score_keys<T, C, G, 1>(query, block + j * row, row, scores + start + j, padded);
    });
    softmax_rows(scores, G, len, padded);
    Floats acc[G][C] = {};
    constexpr int kRows = C * kWidth <= 64 ? 4 : 1;
    for_each_block(cache_v, table, len, s, head, [&](int64_t start, const T* block, int64_t count) {
        int64_t j = 0;
        for (; j + kRows <= count; j += kRows)
            accumulate_values<T, C, G, kRows>(block + j * row, row, scores + start + j, padded, acc);
        for (; j < count; j++)
            accumulate_values<T, C, G, 1>(block + j * row, row, scores + start + j, padded, acc);
    });
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) store(out + g * s.head_dim + c * kWidth, acc[g][c]);
}

// All `group` query heads of one (sequence, KV head), kMaxGroup at a time.
template <typename T, int C>
void attend_head(const T* q, const T* cache_k, const T* cache_v, const int64_t* table,
                 int64_t len, const Shape& s, int64_t head, int64_t group, float scale,
                 float* scores, int64_t padded, T* out) {
    for (int64_t g = 0; g < group; g += kMaxGroup) {
        const int64_t n = group - g < kMaxGroup ? group - g : kMaxGroup;
        const T* qg = q + g * s.head_dim;
        T* og = out + g * s.head_dim;
        switch (n) {
            case 1: attend_group<T, C, 1>(qg, cache_k, cache_v, table, len, s, head, scale, scores, padded, og); break;
            case 2: attend_group<T, C, 2>(qg, cache_k, cache_v, table, len, s, head, scale, scores, padded, og); break;
            case 3: attend_group<T, C, 3>(qg, cache_k, cache_v, table, len, s, head, scale, scores, padded, og); break;
            default: attend_group<T, C, 4>(qg, cache_k, cache_v, table, len, s, head, scale, scores, padded, og); break;
        }
    }
}

template <typename T>
using HeadFunction = void (*)(const T*, const T*, const T*, const int64_t*, int64_t, const Shape&,
                              int64_t, int64_t, float, float*, int64_t, T*);

template <typename T>
HeadFunction<T> head_function(int64_t sixteens) {  // head_dim / 16
    switch (sixteens) {
        case 1: return attend_head<T, 1 * kPer16>;
        case 2: return attend_head<T, 2 * kPer16>;
        case 3: return attend_head<T, 3 * kPer16>;
        case 4: return attend_head<T, 4 * kPer16>;
        case 5: return attend_head<T, 5 * kPer16>;
        case 6: return attend_head<T, 6 * kPer16>;
        case 7: return attend_head<T, 7 * kPer16>;
        case 8: return attend_head<T, 8 * kPer16>;
        default: return nullptr;
    }
}

template <typename T>
int decode_attention(const T* q, int64_t q_stride, const T* k, const T* v, int64_t kv_stride,
                     T* cache, const Shape& s, const int64_t* slots, int64_t num_writes,
                     const int64_t* tables, int64_t table_stride, const int64_t* seq_lens,
                     int64_t num_decodes, float scale, T* out, int64_t out_stride) {
    const HeadFunction<T> attend = head_function<T>(s.head_dim / 16);
    if (s.head_dim % 16 != 0 || !attend || s.kv_heads <= 0 || s.heads % s.kv_heads != 0)
        return -1;
    const int64_t row = s.kv_heads * s.head_dim;
    T* cache_k = cache;
    T* cache_v = cache + s.num_blocks * s.block_size * row;
    for (int64_t i = 0; i < num_writes; i++) {
        std::memcpy(cache_k + slots[i] * row, k + i * kv_stride, row * sizeof(T));
        std::memcpy(cache_v + slots[i] * row, v + i * kv_stride, row * sizeof(T));
    }
    const int64_t group = s.heads / s.kv_heads;
    int64_t max_len = 0;
    for (int64_t i = 0; i < num_decodes; i++) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
    const int64_t padded_max = (max_len + kWidth - 1) / kWidth * kWidth;
    const int64_t tasks = num_decodes * s.kv_heads;
#pragma omp parallel if (tasks > 1)
    {
        std::vector<float> scores(std::min(group, int64_t{kMaxGroup}) * padded_max);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t i = task / s.kv_heads, h = task % s.kv_heads;
            const int64_t len = seq_lens[i];
            const int64_t padded = (len + kWidth - 1) / kWidth * kWidth;
            const int64_t offset = h * group * s.head_dim;
            attend(q + i * q_stride + offset, cache_k, cache_v, tables + i * table_stride, len, s,
                   h, group, scale, scores.data(), padded, out + i * out_stride + offset);
        }
    }
    return 0;
}

}  // namespace

#define MESHLLM_DECODE_ATTENTION(NAME, T)                                                       \
    extern "C" int NAME(const void* q, int64_t q_stride, const void* k, const void* v,          \
                        int64_t kv_stride, void* cache, int64_t num_blocks, int64_t block_size, \
                        const int64_t* slots, int64_t num_writes, const int64_t* tables,        \
                        int64_t table_stride, const int64_t* seq_lens, int64_t num_decodes,     \
                        int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,         \
                        void* out, int64_t out_stride) {                                        \
        const Shape shape{num_blocks, block_size, heads, kv_heads, head_dim};                   \
        return decode_attention(static_cast<const T*>(q), q_stride, static_cast<const T*>(k),   \
                                static_cast<const T*>(v), kv_stride, static_cast<T*>(cache),    \
                                shape, slots, num_writes, tables, table_stride, seq_lens,       \
                                num_decodes, scale, static_cast<T*>(out), out_stride);          \
    }

MESHLLM_DECODE_ATTENTION(meshllm_decode_attention_bf16, uint16_t)
MESHLLM_DECODE_ATTENTION(meshllm_decode_attention_f32, float)
