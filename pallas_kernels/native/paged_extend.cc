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
// shared out over XLA's intra-op thread pool.  An item's queries are M = tokens x G rows
// (the GQA group folded into the rows), packed once, transposed and scaled ([D, M]).  Its
// keys go by blocks of KEY_BLOCK, and each block's scores are computed transposed,
// S^T = K Q^T ([keys, M]): K is read where it lies in the pages (one broadcast per key and
// dim, no packed copy), and the online softmax then runs across the rows in vector lanes
// (per-lane max, exp and sum, no horizontal reductions).  P V accumulates into [M, D] with
// V rows read where they lie.  Both products are register-tiled (common.h's scores_tile, values_tile)
// in vectors as wide as the build's (`vf`: AVX-512 or AVX2, common.h).  Key blocks every
// row of the item sees whole skip the mask; key blocks past the item's last position are
// never computed.  Requires head_dim % 16 == 0 (native.py sends other shapes to the XLA
// attention).  The sinks join only the final normalisation of each row, so the key-block
// loop does no extra work.
#include <vector>

#include "common.h"

namespace {

using namespace strata_native;

constexpr float LOG2E = 1.44269504088896341f, LN2 = 0.693147180559945309f;
constexpr int64_t KEY_TILE = 6;     // keys per scores tile (x 2 row vectors: 12 accumulators)
constexpr int64_t KEY_BLOCK = 96;   // keys per block, a multiple of KEY_TILE (48 to 120 measure alike)
constexpr int64_t ITEM_ROWS = 192;  // query rows (tokens x G) an item aims for: each item reads its keys once (96 ran 1.06-1.11x the time)

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

// Scratch of one item (a thread's, reused across the items it takes).  m_pad: rows
// rounded up to whole vectors.
struct Scratch {
  std::vector<float> qt, st, acc, row_max, row_sum, correction, position, zeros;
  std::vector<const float*> k_rows, v_rows;
  std::vector<float*> acc_rows;  // row m of acc
  void fit(int64_t m_pad, int64_t d) {
    qt.assign(d * m_pad, 0.0f);
    st.resize(KEY_BLOCK * m_pad);
    acc.assign(m_pad * d, 0.0f);
    row_max.assign(m_pad, -INFINITY);
    row_sum.assign(m_pad, 0.0f);
    correction.resize(m_pad);
    position.resize(m_pad);
    zeros.assign(d, 0.0f);
    k_rows.resize(KEY_BLOCK);
    v_rows.resize(KEY_BLOCK);
    acc_rows.resize(m_pad);
    for (int64_t m = 0; m < m_pad; ++m) acc_rows[m] = acc.data() + m * d;
  }
};

// The online-softmax update of every row for keys key0 .. key0 + keys - 1, VF rows at a
// time, in base 2 (scores are log2 e times the logits, so 2^(s - max) = e^(logit - max);
// the running max is in base-2 units until the final normalisation): the transposed
// scores become probabilities (exactly 0 where a row may not look),
// the running max / sum / correction are set.  A row that has seen no key yet keeps max
// -inf, sum 0 (its correction multiplies a zero accumulator).
void softmax_block(const Operands& o, const Item& it, Scratch& s, int64_t m_pad, int64_t key0, int64_t keys) {
  const int64_t last_key = key0 + keys - 1;
  // whole: every row sees every key of the block (past the window's edge, before the diagonal)
  const bool whole = last_key <= it.first_pos && (o.window <= 0 || key0 > it.first_pos + it.tokens - 1 - o.window);
  float* st = s.st.data();
  if (o.soft_cap > 0.0f)  // queries were scaled without log2 e: cap in natural units, then to base 2
    for (int64_t i = 0; i < keys * m_pad; ++i) st[i] = o.soft_cap * std::tanh(st[i] / o.soft_cap) * LOG2E;
  const vf minus_inf = splatf(-INFINITY);
  const auto exp2 = [](vf x) { return exp2_nonpositive(x); };
  for (int64_t r0 = 0; r0 < m_pad; r0 += VF) {
    const vf pos = loadf(s.position.data() + r0);
    const vf edge = o.window > 0 ? pos - float(o.window) : minus_inf;  // keys at or before it are out
    const auto sees = [&](int64_t j) {  // the key is at or before the row and inside its window
      const vf key = splatf(float(key0 + j));
      return (key <= pos) & (key > edge);
    };
    online_softmax_lanes(st, m_pad, r0, keys, whole, sees, exp2, s.row_max.data(), s.row_sum.data(),
                         s.correction.data());
  }
}

void attend_item(const Operands& o, const Item& it, Scratch& s) {
  const int64_t G = o.q_heads / o.kv_heads, D = o.head_dim, S = o.page_size, ts = o.kv_heads * D;
  const int64_t m = it.tokens * G, m_pad = (m + VF - 1) / VF * VF;
  s.fit(m_pad, D);
  // rows (token, g), scaled and transposed; padding rows stay 0.  Scores in base 2 (see
  // softmax_block), unless a soft cap must first see them in natural units.
  const float scale = o.soft_cap > 0.0f ? o.sm_scale : o.sm_scale * LOG2E;
  for (int64_t i = 0; i < it.tokens; ++i) {
    const float* src = o.q + ((it.first_token + i) * o.q_heads + it.head * G) * D;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t e = 0; e < D; ++e) s.qt[e * m_pad + i * G + g] = src[g * D + e] * scale;
  }
  for (int64_t r = 0; r < m_pad; ++r)  // padding rows: the last token's position (finite, never written out)
    s.position[r] = float(it.first_pos + std::min(r, m - 1) / G);
  const int32_t* table = o.table + it.row * o.width;
  for (int64_t key0 = it.key_lo; key0 < it.key_hi; key0 += KEY_BLOCK) {
    const int64_t keys = std::min<int64_t>(KEY_BLOCK, it.key_hi - key0);
    const int64_t tiled = (keys + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
    for (int64_t j = 0; j < keys; ++j) {  // K and V rows where they lie in the pages
      const int64_t pos = key0 + j, page_index = std::min<int64_t>(pos / S, o.width - 1);
      const int64_t page = std::clamp<int64_t>(table[page_index], 0, o.pages - 1);
      const int64_t at = (page * S + pos % S) * ts + it.head * D;
      s.k_rows[j] = o.k_layer + at;
      s.v_rows[j] = o.v_layer + at;
    }
    for (int64_t j = keys; j < tiled; ++j) s.k_rows[j] = s.zeros.data();  // a whole last tile; never read after
    scores_tiles<KEY_TILE>(s.qt.data(), m_pad, s.k_rows.data(), s.st.data(), tiled, D);
    softmax_block(o, it, s, m_pad, key0, keys);
    values_tiles(s.st.data(), m_pad, s.v_rows.data(), keys, s.correction.data(), s.acc_rows.data(), D);
  }
  for (int64_t i = 0; i < it.tokens; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;  // query head it.head * G + g
      const float max = s.row_max[r] * LN2;  // to natural units, as the sink logit
      const float inv = sink_normalizer(max, s.row_sum[r], o.sinks[it.head * G + g]);
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
  if (td.size() != 2 || p.head_dim % 16 != 0 || query_start.element_count() != td[0] + 1 ||
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

// The vector width this build's extend kernel uses (native.py's vector_bits(), status()).
extern "C" int strata_native_vector_bits() { return STRATA_VECTOR_BITS; }

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
