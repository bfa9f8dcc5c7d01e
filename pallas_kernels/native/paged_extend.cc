// Paged extend (prefill) attention on CPU, an XLA FFI custom call (pallas_kernels/native.py
// builds and registers it).  Each sequence's new tokens attend causally to its KV in the
// paged pool (the chunk's own KV already written), with the flash-attention online softmax
// in float32.  Memory and time are linear in the chunk: a block of queries walks the
// keys it can see in blocks of KEY_BLOCK, and nothing the size of tokens x context exists.
//
//   q           f32[T, QH, D]            queries (QH = H * G: the G query heads of KV head
//                                        h are h * G .. h * G + G - 1)
//   pool        f32[L, 2, P, S, H, D]    the paged KV pool (k = [l, 0], v = [l, 1])
//   layer       s32[]                    which layer of the pool
//   table       s32[B, W]                each row's page table
//   query_start s32[B + 1]               row b's tokens are query_start[b] .. query_start[b + 1] - 1
//   seq_lens    s32[B]                   row b's KV length after the step: its n new tokens
//                                        sit at positions seq_lens[b] - n .. seq_lens[b] - 1
//   window      s32[]                    > 0: a token at p sees positions p - window + 1 .. p
//   sinks       f32[QH]                  each query head's learned sink logit (GPT-OSS), one
//                                        more score in its softmax denominator with no
//                                        value; -inf: none
//   attrs       sm_scale, soft_cap (0: none)
//   out         f32[T, QH, D]            tokens past query_start[B] (padding) get zeros
//
// Work items are (row, KV head, block of query tokens) triples, the most keys first,
// shared out over XLA's intra-op thread pool.  An item packs its queries as M = tokens x G
// rows (the GQA group folded into the rows, scaled by sm_scale), and for every key block
// packs K transposed ([D, KEY_BLOCK]) from the pages; the two products are register-tiled
// (6 query rows x 16 keys for Q K^T, 6 rows x 16 dims for P V).  V rows are read where
// they lie.  Key blocks every row of the item sees whole skip the mask.  Requires
// head_dim % 16 == 0 (native.py sends other shapes to the XLA attention).  The sinks join
// only the final normalisation of each row, so the key-block loop does no extra work.
#include <vector>

#include "common.h"

namespace {

using namespace strata_native;

constexpr int64_t TILE_ROWS = 6;    // query rows per register tile
constexpr int64_t TILE_COLS = 16;   // keys (Q K^T) or dims (P V) per register tile
constexpr int64_t KEY_BLOCK = 64;   // keys per block
constexpr int64_t ITEM_ROWS = 96;   // query rows (tokens x G) an item aims for

struct Operands {
  int64_t tokens, q_heads, head_dim, pages, page_size, kv_heads, width, rows;
  const float* q;
  const float* k_layer;  // the layer's K pages [P, S, H, D]
  const float* v_layer;
  const int32_t* table;
  const int32_t* query_start;
  const int32_t* seq_lens;
  const float* sinks;  // [QH]
  int32_t window;
  float sm_scale, soft_cap;
  float* out;
};

struct Item {
  int64_t row, head, first_token, tokens;  // tokens first_token .. first_token + tokens - 1 of the batch
  int64_t first_pos;                       // position of first_token
  int64_t key_lo, key_hi;                  // keys any of them sees: key_lo .. key_hi - 1
};

// Scratch of one item (a thread's, reused across the items it takes).
struct Scratch {
  std::vector<float> q, kt, scores, acc, row_max, row_sum, correction;
  std::vector<const float*> v_rows;
  void fit(int64_t m_pad, int64_t d) {
    q.assign(m_pad * d, 0.0f);
    kt.resize(d * KEY_BLOCK);
    scores.resize(m_pad * KEY_BLOCK);
    acc.assign(m_pad * d, 0.0f);
    row_max.assign(m_pad, -INFINITY);
    row_sum.assign(m_pad, 0.0f);
    correction.resize(m_pad);
    v_rows.resize(KEY_BLOCK);
  }
};

// scores[m, j] = q[m, :] . kt[:, j] for rows m0 .. m0 + 5, keys j0 .. j0 + 15.
inline void qk_tile(const float* q, const float* kt, float* scores, int64_t m0, int64_t j0, int64_t d) {
  v8 c[TILE_ROWS][2] = {};
  for (int64_t e = 0; e < d; ++e) {
    const v8 k0 = load(kt + e * KEY_BLOCK + j0), k1 = load(kt + e * KEY_BLOCK + j0 + 8);
    for (int64_t r = 0; r < TILE_ROWS; ++r) {
      const v8 qv = splat(q[(m0 + r) * d + e]);
      c[r][0] += qv * k0;
      c[r][1] += qv * k1;
    }
  }
  for (int64_t r = 0; r < TILE_ROWS; ++r) {
    store(scores + (m0 + r) * KEY_BLOCK + j0, c[r][0]);
    store(scores + (m0 + r) * KEY_BLOCK + j0 + 8, c[r][1]);
  }
}

// acc[m, e0 .. e0 + 15] = acc[m, ...] * correction[m] + sum_j p[m, j] v[j, e0 ..], rows m0 .. m0 + 5.
inline void pv_tile(const float* p, const float* const* v_rows, int64_t keys, const float* correction, float* acc,
                    int64_t m0, int64_t e0, int64_t d) {
  v8 c[TILE_ROWS][2];
  for (int64_t r = 0; r < TILE_ROWS; ++r) {
    const v8 s = splat(correction[m0 + r]);
    c[r][0] = load(acc + (m0 + r) * d + e0) * s;
    c[r][1] = load(acc + (m0 + r) * d + e0 + 8) * s;
  }
  for (int64_t j = 0; j < keys; ++j) {
    const v8 v0 = load(v_rows[j] + e0), v1 = load(v_rows[j] + e0 + 8);
    for (int64_t r = 0; r < TILE_ROWS; ++r) {
      const v8 pv = splat(p[(m0 + r) * KEY_BLOCK + j]);
      c[r][0] += pv * v0;
      c[r][1] += pv * v1;
    }
  }
  for (int64_t r = 0; r < TILE_ROWS; ++r) {
    store(acc + (m0 + r) * d + e0, c[r][0]);
    store(acc + (m0 + r) * d + e0 + 8, c[r][1]);
  }
}

// The online-softmax update of rows 0 .. m - 1 for keys key0 .. key0 + keys - 1: scores
// become probabilities (0 where a row may not look), running max / sum / correction set.
void softmax_block(const Operands& o, const Item& it, Scratch& s, int64_t m, int64_t key0, int64_t keys) {
  const int64_t G = o.q_heads / o.kv_heads;
  const int64_t last_key = key0 + keys - 1;
  // whole: every row sees every key of the block (past the window's edge, before the diagonal)
  const bool whole = last_key <= it.first_pos && (o.window <= 0 || key0 > it.first_pos + it.tokens - 1 - o.window);
  for (int64_t r = 0; r < m; ++r) {
    float* sr = s.scores.data() + r * KEY_BLOCK;
    int64_t lo = 0, hi = keys;  // this row's visible keys in the block
    if (!whole) {
      const int64_t pos = it.first_pos + r / G;
      hi = std::min<int64_t>(keys, pos - key0 + 1);
      if (o.window > 0) lo = std::max<int64_t>(0, pos - o.window + 1 - key0);
    }
    if (hi <= lo) {  // nothing visible in this block: the row's state stands
      s.correction[r] = 1.0f;
      std::fill(sr, sr + KEY_BLOCK, 0.0f);
      continue;
    }
    if (o.soft_cap > 0.0f)
      for (int64_t j = lo; j < hi; ++j) sr[j] = o.soft_cap * std::tanh(sr[j] / o.soft_cap);
    float block_max = -INFINITY;
    {
      int64_t j = lo;
      if (hi - lo >= 8) {
        v8 m8 = load(sr + lo);
        for (j = lo + 8; j + 8 <= hi; j += 8) {
          const v8 x = load(sr + j);
          m8 = x > m8 ? x : m8;
        }
        for (int i = 0; i < 8; ++i) block_max = std::max(block_max, m8[i]);
      }
      for (; j < hi; ++j) block_max = std::max(block_max, sr[j]);
    }
    const float new_max = std::max(s.row_max[r], block_max);
    s.correction[r] = exp_nonpositive(s.row_max[r] - new_max);  // row_max = -inf: ~0 times a zero acc
    s.row_max[r] = new_max;
    for (int64_t j = 0; j < lo; ++j) sr[j] = 0.0f;
    int64_t j = lo;
    v8 sum8 = {};
    for (; j + 8 <= hi; j += 8) {
      const v8 p = exp_nonpositive(load(sr + j) - new_max);
      store(sr + j, p);
      sum8 += p;
    }
    float sum = 0.0f;
    for (int i = 0; i < 8; ++i) sum += sum8[i];
    for (; j < hi; ++j) sum += sr[j] = exp_nonpositive(sr[j] - new_max);
    for (j = hi; j < KEY_BLOCK; ++j) sr[j] = 0.0f;
    s.row_sum[r] = s.row_sum[r] * s.correction[r] + sum;
  }
}

void attend_item(const Operands& o, const Item& it, Scratch& s) {
  const int64_t G = o.q_heads / o.kv_heads, D = o.head_dim, S = o.page_size, ts = o.kv_heads * D;
  const int64_t m = it.tokens * G, m_pad = (m + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
  s.fit(m_pad, D);
  for (int64_t i = 0; i < it.tokens; ++i) {  // rows (token, g), scaled; padding rows stay 0
    const float* src = o.q + ((it.first_token + i) * o.q_heads + it.head * G) * D;
    for (int64_t e = 0; e < G * D; ++e) s.q[i * G * D + e] = src[e] * o.sm_scale;
  }
  const int32_t* table = o.table + it.row * o.width;
  for (int64_t key0 = it.key_lo; key0 < it.key_hi; key0 += KEY_BLOCK) {
    const int64_t keys = std::min<int64_t>(KEY_BLOCK, it.key_hi - key0);
    const int64_t cols = (keys + TILE_COLS - 1) / TILE_COLS * TILE_COLS;
    for (int64_t j = 0; j < keys; ++j) {  // K transposed; V rows where they lie
      const int64_t pos = key0 + j, page_index = std::min<int64_t>(pos / S, o.width - 1);
      const int64_t page = std::clamp<int64_t>(table[page_index], 0, o.pages - 1);
      const int64_t at = (page * S + pos % S) * ts + it.head * D;
      const float* k = o.k_layer + at;
      for (int64_t e = 0; e < D; ++e) s.kt[e * KEY_BLOCK + j] = k[e];
      s.v_rows[j] = o.v_layer + at;
    }
    for (int64_t j = keys; j < cols; ++j)
      for (int64_t e = 0; e < D; ++e) s.kt[e * KEY_BLOCK + j] = 0.0f;
    for (int64_t m0 = 0; m0 < m_pad; m0 += TILE_ROWS)
      for (int64_t j0 = 0; j0 < cols; j0 += TILE_COLS) qk_tile(s.q.data(), s.kt.data(), s.scores.data(), m0, j0, D);
    softmax_block(o, it, s, m, key0, keys);
    for (int64_t r = m; r < m_pad; ++r) {  // padding rows: keep them finite zeros
      s.correction[r] = 0.0f;
      std::fill(s.scores.begin() + r * KEY_BLOCK, s.scores.begin() + (r + 1) * KEY_BLOCK, 0.0f);
    }
    for (int64_t m0 = 0; m0 < m_pad; m0 += TILE_ROWS)
      for (int64_t e0 = 0; e0 < D; e0 += TILE_COLS)
        pv_tile(s.scores.data(), s.v_rows.data(), keys, s.correction.data(), s.acc.data(), m0, e0, D);
  }
  for (int64_t i = 0; i < it.tokens; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;  // query head it.head * G + g
      const float inv = sink_normalizer(s.row_max[r], s.row_sum[r], o.sinks[it.head * G + g]);
      float* y = o.out + ((it.first_token + i) * o.q_heads + it.head * G + g) * D;
      for (int64_t e = 0; e < D; ++e) y[e] = s.acc[r * D + e] * inv;
    }
}

ffi::Error PagedExtendImpl(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> pool,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> table,
                           ffi::Buffer<ffi::S32> query_start, ffi::Buffer<ffi::S32> seq_lens,
                           ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::F32> sinks, float sm_scale,
                           float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  PoolLayer p;
  if (ffi::Error e = pool_layer("paged_extend_attention", q, pool, layer, sinks, p); e.failure()) return e;
  const auto td = table.dimensions();
  if (td.size() != 2 || p.head_dim % TILE_COLS != 0 || query_start.element_count() != td[0] + 1 ||
      seq_lens.element_count() != td[0] || window.element_count() != 1) {
    return ffi::Error::InvalidArgument("paged_extend_attention: operand shapes do not agree");
  }
  const int64_t tokens = p.tokens, q_heads = p.q_heads, kv_heads = p.kv_heads, rows = td[0];
  float* y = out->typed_data();
  std::fill(y, y + tokens * q_heads * p.head_dim, 0.0f);
  const Operands o{tokens, q_heads, p.head_dim, p.pages, p.page_size, kv_heads, td[1], rows, q.typed_data(), p.k, p.v,
                   table.typed_data(), query_start.typed_data(), seq_lens.typed_data(), p.sinks,
                   window.typed_data()[0], sm_scale, soft_cap, y};
  const int64_t G = q_heads / kv_heads;
  const int64_t block_tokens = std::max<int64_t>(1, (ITEM_ROWS + G - 1) / G);
  std::vector<Item> items;
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t begin = std::max<int64_t>(0, o.query_start[b]);
    const int64_t end = std::min<int64_t>(tokens, o.query_start[b + 1]);
    const int64_t n = o.query_start[b + 1] - o.query_start[b];
    if (end <= begin || n <= 0 || o.seq_lens[b] < n) continue;  // an empty or padding row
    const int64_t first_pos = o.seq_lens[b] - n;
    for (int64_t t = begin; t < end; t += block_tokens) {
      const int64_t count = std::min<int64_t>(block_tokens, end - t), pos = first_pos + (t - begin);
      const int64_t key_lo = o.window > 0 ? std::max<int64_t>(0, pos - o.window + 1) : 0;
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({b, h, t, count, pos, key_lo, pos + count});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {  // longest first: even finish
    return (a.key_hi - a.key_lo) * a.tokens > (b.key_hi - b.key_lo) * b.tokens;
  });
  parallel_for(threads, int64_t(items.size()), [&o, &items](int64_t i) {
    thread_local Scratch scratch;  // per pool thread, reused across items and calls
    attend_item(o, items[i], scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataPagedExtendAttention, PagedExtendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
