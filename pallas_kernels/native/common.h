// Helpers the native CPU kernels share: 8-float vectors (GCC/Clang vector extensions,
// AVX on x86, NEON pairs on ARM) and vectors as wide as the CPU's (`vf`: 16 floats where
// the build targets AVX-512, else 8), a vectorized exp for the online softmax, a parallel
// loop over XLA's intra-op thread pool, and the softmax's final normalisation with the
// learned attention sinks.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace strata_native {

namespace ffi = xla::ffi;

typedef float v8 __attribute__((vector_size(32), aligned(4)));  // unaligned loads and stores
typedef int32_t i8v __attribute__((vector_size(32)));

inline v8 load(const float* p) { return *reinterpret_cast<const v8*>(p); }
inline void store(float* p, v8 x) { *reinterpret_cast<v8*>(p) = x; }
inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

// The widest vector the build targets: native.py passes -DSTRATA_VECTOR_BITS=256 to force
// the AVX2-width code on an AVX-512 CPU (to test it, or where 512-bit code clocks down);
// otherwise -march=native decides.  strata_native_vector_bits() reports the choice.
#ifndef STRATA_VECTOR_BITS
#ifdef __AVX512F__
#define STRATA_VECTOR_BITS 512
#else
#define STRATA_VECTOR_BITS 256
#endif
#endif
constexpr int VF = STRATA_VECTOR_BITS / 32;  // floats per vf
typedef float vf __attribute__((vector_size(STRATA_VECTOR_BITS / 8), aligned(4)));  // unaligned
typedef int32_t vfi __attribute__((vector_size(STRATA_VECTOR_BITS / 8)));

inline vf loadf(const float* p) { return *reinterpret_cast<const vf*>(p); }
inline void storef(float* p, vf x) { *reinterpret_cast<vf*>(p) = x; }
// Every lane spelled out: one broadcast (`vf{} + x` adds 0 first, since -0.0 + 0 != -0.0,
// and a lane-by-lane loop compiles to inserts).
#if STRATA_VECTOR_BITS == 512
inline vf splatf(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#else
inline vf splatf(float x) { return vf{x, x, x, x, x, x, x, x}; }
#endif

#ifdef __clang__
#define SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, i8v{__VA_ARGS__})
#endif

// exp(x) for x <= 0 (scores minus their running max), a vector at a time: Cody-Waite range
// reduction and a degree-6 polynomial (relative error ~2e-7); x below -87 gives ~1e-38.
template <typename V, typename I>
inline V exp_nonpositive_any(V x) {
  const V floor = V{} - 87.0f;
  x = x < floor ? floor : x;
  // round to nearest by adding and subtracting 1.5 * 2^23 (|x log2 e| < 2^22)
  const V n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  V r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// 2^x for x <= 0, a vector at a time: the extend kernel's scores are in base 2 (queries
// scaled by log2 e), so the range reduction is one rounding, r = x - n in [-1/2, 1/2]
// exactly, and 2^r a degree-6 polynomial (Chebyshev fit, relative error 1.1e-7): ~14
// vector operations against exp_nonpositive's ~18.  x below -126 gives 2^-126.
template <typename V, typename I>
inline V exp2_nonpositive_any(V x) {
  const V floor = V{} - 126.0f;
  x = x < floor ? floor : x;
  const V n = (x + 12582912.0f) - 12582912.0f;  // round to nearest (|x| < 2^22)
  const V r = x - n;
  V p = V{} + 1.5465312753804028e-4f;
  p = p * r + 1.3395280111581087e-3f;
  p = p * r + 9.618040174245834e-3f;
  p = p * r + 5.550340563058853e-2f;
  p = p * r + 2.4022650718688965e-1f;
  p = p * r + 6.931471824645996e-1f;
  p = p * r + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline v8 exp_nonpositive(v8 x) { return exp_nonpositive_any<v8, i8v>(x); }
inline vf exp2_nonpositive(vf x) { return exp2_nonpositive_any<vf, vfi>(x); }
inline vf exp_nonpositive_wide(vf x) { return exp_nonpositive_any<vf, vfi>(x); }
inline float exp_nonpositive(float x) { return exp_nonpositive(splat(x))[0]; }

// The online-softmax update of lanes r0 .. r0 + VF - 1 for `keys` transposed scores
// st[j * m_pad + r0] (one query row per lane), shared by the extend kernel (Exp = 2^x: its
// scores are in base 2) and the decode kernel's shared pages (Exp = e^x).  Scores a lane may
// not look at (sees(j) false in that lane) become exactly 0, the others exp(score - new max);
// max, sum and correction are the lanes' running state, updated in place.  A lane that has
// seen no key yet keeps max -inf, sum 0 (its correction multiplies a zero accumulator).
// all_see: every lane sees every key (no masking work at all).
template <typename Exp, typename Sees>
inline void online_softmax_lanes(float* st, int64_t m_pad, int64_t r0, int64_t keys, bool all_see, Sees sees, Exp exp,
                                 float* max, float* sum, float* correction) {
  const vf minus_inf = splatf(-INFINITY), zero = {};
  const vf old_max = loadf(max + r0);
  vf block_max = minus_inf;
  for (int64_t j = 0; j < keys; ++j) {
    vf x = loadf(st + j * m_pad + r0);
    if (!all_see) {
      x = sees(j) ? x : minus_inf;
      storef(st + j * m_pad + r0, x);
    }
    block_max = x > block_max ? x : block_max;
  }
  const vf new_max = old_max > block_max ? old_max : block_max;
  const vf base = new_max == minus_inf ? zero : new_max;  // nothing seen yet: no -inf - -inf
  const vf scale_old = exp(old_max - base);
  vf block_sum = zero;
  for (int64_t j = 0; j < keys; ++j) {
    const vf x = loadf(st + j * m_pad + r0);
    vf p = exp(x - base);
    if (!all_see) p = x == minus_inf ? zero : p;
    storef(st + j * m_pad + r0, p);
    block_sum += p;
  }
  storef(correction + r0, scale_old);
  storef(max + r0, new_max);
  storef(sum + r0, loadf(sum + r0) * scale_old + block_sum);
}

// Register tiles of the two attention products, shared by the extend kernel and the
// decode kernel's pages shared by several tokens.  Queries sit in vector lanes: `qt` is
// [D, m_pad] (rows transposed), scores come out transposed, st[j, m] ([keys, m_pad]).

// st[j, m] = k_j . qt[:, m] for keys j0 .. j0 + KT - 1 (k_rows: each key's D floats where
// they lie) and rows m0 .. m0 + NV * VF - 1.  KT x NV accumulators (12 or 8).
template <int KT, int NV>
inline void scores_tile(const float* qt, int64_t m_pad, const float* const* k_rows, float* st, int64_t j0, int64_t m0,
                        int64_t d) {
  vf c[KT][NV] = {};
  const float* k[KT];
  for (int t = 0; t < KT; ++t) k[t] = k_rows[j0 + t];
  for (int64_t e = 0; e < d; ++e) {
    vf qv[NV];
    for (int n = 0; n < NV; ++n) qv[n] = loadf(qt + e * m_pad + m0 + n * VF);
    for (int t = 0; t < KT; ++t) {
      const vf kv = splatf(k[t][e]);
      for (int n = 0; n < NV; ++n) c[t][n] += kv * qv[n];
    }
  }
  for (int t = 0; t < KT; ++t)
    for (int n = 0; n < NV; ++n) storef(st + (j0 + t) * m_pad + m0 + n * VF, c[t][n]);
}

// Rows per values tile (x 2 vectors of dims: 8 accumulators at 256 bits, 16 at 512); divides VF.
constexpr int64_t VALUE_ROWS = VF == 16 ? 8 : 4;

// acc_rows[m][e0 .. e0 + DV * VF - 1] = acc_rows[m][...] * correction[m] + sum_j pt[j, m] v_j[e0 ..]
// for rows m0 .. m0 + VALUE_ROWS - 1 and keys 0 .. keys - 1 (pt: probabilities, [keys, m_pad]).
template <int DV>
inline void values_tile(const float* pt, int64_t m_pad, const float* const* v_rows, int64_t keys,
                        const float* correction, float* const* acc_rows, int64_t m0, int64_t e0) {
  vf c[VALUE_ROWS][DV];
  for (int64_t r = 0; r < VALUE_ROWS; ++r) {
    const vf s = splatf(correction[m0 + r]);
    for (int n = 0; n < DV; ++n) c[r][n] = loadf(acc_rows[m0 + r] + e0 + n * VF) * s;
  }
  for (int64_t j = 0; j < keys; ++j) {
    vf v[DV];
    for (int n = 0; n < DV; ++n) v[n] = loadf(v_rows[j] + e0 + n * VF);
    const float* p = pt + j * m_pad + m0;
    for (int64_t r = 0; r < VALUE_ROWS; ++r) {
      const vf pv = splatf(p[r]);
      for (int n = 0; n < DV; ++n) c[r][n] += pv * v[n];
    }
  }
  for (int64_t r = 0; r < VALUE_ROWS; ++r)
    for (int n = 0; n < DV; ++n) storef(acc_rows[m0 + r] + e0 + n * VF, c[r][n]);
}

// Every values tile of rows 0 .. m_pad - 1 (a multiple of VF) and dims 0 .. d - 1 (a
// multiple of 16): 2-vector tiles, then a 1-vector tile for the last 16 dims at 512 bits.
inline void values_tiles(const float* pt, int64_t m_pad, const float* const* v_rows, int64_t keys,
                         const float* correction, float* const* acc_rows, int64_t d) {
  for (int64_t r0 = 0; r0 < m_pad; r0 += VALUE_ROWS) {
    int64_t e0 = 0;
    for (; e0 + 2 * VF <= d; e0 += 2 * VF) values_tile<2>(pt, m_pad, v_rows, keys, correction, acc_rows, r0, e0);
    for (; e0 < d; e0 += VF) values_tile<1>(pt, m_pad, v_rows, keys, correction, acc_rows, r0, e0);
  }
}

// Every scores tile of keys 0 .. keys_tiled - 1 (a multiple of KT) and rows 0 .. m_pad - 1.
template <int KT>
inline void scores_tiles(const float* qt, int64_t m_pad, const float* const* k_rows, float* st, int64_t keys_tiled,
                         int64_t d) {
  int64_t m0 = 0;
  for (; m0 + 2 * VF <= m_pad; m0 += 2 * VF)
    for (int64_t j0 = 0; j0 < keys_tiled; j0 += KT) scores_tile<KT, 2>(qt, m_pad, k_rows, st, j0, m0, d);
  if (m0 < m_pad)  // a last single vector of rows
    for (int64_t j0 = 0; j0 < keys_tiled; j0 += KT) scores_tile<KT, 1>(qt, m_pad, k_rows, st, j0, m0, d);
}

// The lane sums of a[0..7], as one vector (a transpose and add in three rounds).
inline v8 transpose_sum(const v8* a) {
  v8 u[4], w[2];
  for (int i = 0; i < 4; ++i)
    u[i] = SHUFFLE2(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE2(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int i = 0; i < 2; ++i)
    w[i] = SHUFFLE2(u[2 * i], u[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE2(u[2 * i], u[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return SHUFFLE2(w[0], w[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE2(w[0], w[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// The factor a row's unnormalized output is multiplied by: 1 / its softmax denominator,
// the denominator holding the query head's learned sink logit (GPT-OSS) as one more score
// that attends to no value.  `m`: the row's running max, `l`: its sum of exp(score - m).
// With m' = max(m, sink): out = acc e^(m - m') / (l e^(m - m') + e^(sink - m')).  Once per
// row and head, so std::exp (exact at 0 and -inf) rather than exp_nonpositive: a sink of
// -inf (none) gives e^0 = 1 and e^-inf = 0 exactly, so 1 / l, bit for bit the result
// without sinks.  A row that saw no key (l = 0: padding, m = -inf) gives 0 whatever the
// sink, and never computes -inf - -inf.
inline float sink_normalizer(float m, float l, float sink) {
  if (!(l > 0.0f)) return 0.0f;
  const float new_max = std::max(m, sink);
  const float scale = std::exp(m - new_max);  // 1 unless the sink is the larger
  return scale / (l * scale + std::exp(sink - new_max));
}

struct Progress {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// fn(0 .. items - 1) on the calling thread and up to `helpers` pool threads.  The caller
// takes items too, so a pool with no free thread only makes it slower, never stuck;
// helpers that start late find nothing left (the counters outlive this call).
template <typename Fn>
void parallel_for(ffi::ThreadPool& threads, int64_t items, Fn fn) {
  auto progress = std::make_shared<Progress>();
  auto work = [progress, items, fn]() {
    int64_t i;
    while ((i = progress->next.fetch_add(1)) < items) {
      fn(i);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(threads.num_threads(), items - 1);
  for (int64_t i = 0; i < helpers; ++i) threads.Schedule([work]() { work(); });
  work();
  while (progress->done.load(std::memory_order_acquire) < items) std::this_thread::yield();
}

// The operands every kernel shares: q [T, QH, D], the pool [L, 2, P, S, H, D], the
// layer index and the sinks [QH]; the layer's K and V pages [P, S, H, D].
struct PoolLayer {
  int64_t tokens, q_heads, head_dim, pages, page_size, kv_heads;
  const float* k;
  const float* v;
  const float* sinks;  // one logit per query head; -inf: none (native.py sends -inf for sinks=None)
};

// Checks q against the pool (ranks, K/V pair, head_dim, GQA group), the layer index and
// the sinks (one per query head); errors name the kernel.  Each kernel checks its row
// operands itself.
inline ffi::Error pool_layer(const char* kernel, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& pool,
                             ffi::Buffer<ffi::S32>& layer, ffi::Buffer<ffi::F32>& sinks, PoolLayer& out) {
  const auto qd = q.dimensions(), pd = pool.dimensions();
  if (qd.size() != 3 || pd.size() != 6 || pd[1] != 2 || pd[5] != qd[2] || qd[1] % pd[4] != 0 ||
      layer.element_count() != 1) {
    return ffi::Error::InvalidArgument(std::string(kernel) + ": operand shapes do not agree");
  }
  if (int64_t(sinks.element_count()) != qd[1]) {
    return ffi::Error::InvalidArgument(std::string(kernel) + ": sinks has " + std::to_string(sinks.element_count()) +
                                       " elements, want one per query head (" + std::to_string(qd[1]) + ")");
  }
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= pd[0]) return ffi::Error::InvalidArgument(std::string(kernel) + ": layer out of range");
  const int64_t kv_stride = pd[2] * pd[3] * pd[4] * pd[5];
  const float* base = pool.typed_data() + 2 * int64_t(l) * kv_stride;
  out = {qd[0], qd[1], qd[2], pd[2], pd[3], pd[4], base, base + kv_stride, sinks.typed_data()};
  return ffi::Error::Success();
}

}  // namespace strata_native
