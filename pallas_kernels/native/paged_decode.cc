// Paged decode attention on CPU, an XLA FFI custom call (pallas_kernels/native.py builds
// and registers it).  One query token per row reads its sequence's KV straight from the
// paged pool, page by page, with the flash-attention online softmax in float32: no
// gathered copy of the KV; each page is read once per token, all heads at once.
//
//   q          f32[T, QH, D]            queries (QH = H * G: the G query heads of KV head h
//                                       are h * G .. h * G + G - 1)
//   pool       f32[L, 2, P, S, H, D]    the paged KV pool (k = [l, 0], v = [l, 1])
//   layer      s32[]                    which layer of the pool
//   table      s32[T, W]                each token's page table
//   kv_len     s32[T]                   KV positions 0 .. kv_len - 1 exist (0: padding row)
//   window     s32[]                    > 0: read only the last `window` positions
//   sinks      f32[QH]                  each query head's learned sink logit (GPT-OSS), one
//                                       more score in its softmax denominator with no value;
//                                       -inf: none
//   attrs      sm_scale, soft_cap (0: none)
//   out        f32[T, QH, D]
//
// Work items are (token, part of its KV range) pairs, shared out over XLA's intra-op
// thread pool; a token's parts are merged at the end (flash-decoding), so one long row
// still keeps every core busy.  Vector code uses GCC/Clang vector extensions (8 floats),
// which compile to AVX on x86 and NEON pairs on ARM.  The sinks join only the merge's
// final normalisation (once per token and head), so the page loop does no extra work.
#include <vector>

#include "common.h"

namespace {

using namespace strata_native;

struct Operands {
  int64_t tokens, q_heads, head_dim, pages, page_size, kv_heads, width;
  const float* q;
  const float* k_layer;  // the layer's K pages [P, S, H, D]
  const float* v_layer;
  const int32_t* table;
  const int32_t* kv_len;
  const float* sinks;  // [QH]
  int32_t window;
  float sm_scale, soft_cap;
  int64_t splits;   // each token's KV range is cut into this many page-aligned parts
  float* part_acc;  // [T, splits, QH, D] unnormalized outputs of each part
  float* part_max;  // [T, splits, QH]
  float* part_sum;  // [T, splits, QH]
};

// scores[qh * S + j] = q[qh] . k[j, qh / G] for every slot j of the page (slots outside
// the valid range are computed too and masked by the caller).  Vector path: D and S
// multiples of 8, eight slots at a time.
void page_scores(const Operands& o, const float* qs, const float* k_page, float* scores) {
  const int64_t QH = o.q_heads, D = o.head_dim, S = o.page_size, G = QH / o.kv_heads, ts = o.kv_heads * D;
  if (D % 8 != 0 || S % 8 != 0) {
    for (int64_t qh = 0; qh < QH; ++qh)
      for (int64_t j = 0; j < S; ++j) {
        const float* k = k_page + j * ts + (qh / G) * D;
        float dot = 0.0f;
        for (int64_t d = 0; d < D; ++d) dot += qs[qh * D + d] * k[d];
        scores[qh * S + j] = dot;
      }
    return;
  }
  for (int64_t qh = 0; qh < QH; ++qh) {
    const float* q = qs + qh * D;
    const float* k_head = k_page + (qh / G) * D;
    for (int64_t j0 = 0; j0 < S; j0 += 8) {
      v8 acc[8] = {};
      for (int64_t c = 0; c < D; c += 8) {
        const v8 qc = load(q + c);
        for (int t = 0; t < 8; ++t) acc[t] += qc * load(k_head + (j0 + t) * ts + c);
      }
      store(scores + qh * S + j0, transpose_sum(acc));
    }
  }
}

// acc[0..D) += sum over slots lo .. hi - 1 of p[j] * v[j] (one query head).
void page_values(float* acc, const float* p, const float* v_head, int64_t lo, int64_t hi, int64_t D, int64_t ts) {
  if (D % 8 != 0) {
    for (int64_t j = lo; j < hi; ++j)
      for (int64_t d = 0; d < D; ++d) acc[d] += p[j] * v_head[j * ts + d];
    return;
  }
  for (int64_t c = 0; c < D; c += 8) {
    v8 a[4] = {load(acc + c), {}, {}, {}};  // four chains: an add's latency is not the loop's pace
    int64_t j = lo;
    for (; j + 4 <= hi; j += 4)
      for (int u = 0; u < 4; ++u) a[u] += splat(p[j + u]) * load(v_head + (j + u) * ts + c);
    for (; j < hi; ++j) a[0] += splat(p[j]) * load(v_head + j * ts + c);
    store(acc + c, (a[0] + a[1]) + (a[2] + a[3]));
  }
}

// A token's valid KV positions [first, n) as pages [first_page, end_page).
struct Span {
  int64_t first, n, first_page, end_page;
};

Span span_of(const Operands& o, int64_t t) {
  const int64_t n = o.kv_len[t], S = o.page_size;
  if (n <= 0) return {0, 0, 0, 0};
  const int64_t first = o.window > 0 ? std::max<int64_t>(0, n - o.window) : 0;
  return {first, n, first / S, std::min<int64_t>((n - 1) / S + 1, o.width)};  // never past the table
}

void prefetch_page(const Operands& o, int64_t page) {
  if (page < 0 || page >= o.pages) return;
  const int64_t bytes = o.page_size * o.kv_heads * o.head_dim * int64_t(sizeof(float));
  const char* k = reinterpret_cast<const char*>(o.k_layer) + page * bytes;
  const char* v = reinterpret_cast<const char*>(o.v_layer) + page * bytes;
  for (int64_t b = 0; b < bytes; b += 64) {
    __builtin_prefetch(k + b);
    __builtin_prefetch(v + b);
  }
}

// One page of a token (slots lo .. hi - 1), every query head, folded into part state
// `at` (the online softmax).  `qs`: the token's scaled queries; `scores`: QH * S scratch.
void attend_page(const Operands& o, int64_t page, int64_t lo, int64_t hi, const float* qs, float* scores,
                 int64_t at) {
  const int64_t QH = o.q_heads, D = o.head_dim, S = o.page_size, G = QH / o.kv_heads;
  const int64_t ts = o.kv_heads * D, page_stride = S * ts;
  float* acc = o.part_acc + at * QH * D;
  float* row_max = o.part_max + at * QH;
  float* row_sum = o.part_sum + at * QH;
  const float* v_page = o.v_layer + page * page_stride;
  page_scores(o, qs, o.k_layer + page * page_stride, scores);
  for (int64_t qh = 0; qh < QH; ++qh) {
    float* sq = scores + qh * S;
    // slots outside lo .. hi - 1 may hold anything (unwritten: NaN in tests): never read
    if (o.soft_cap > 0.0f)
      for (int64_t j = lo; j < hi; ++j) sq[j] = o.soft_cap * std::tanh(sq[j] / o.soft_cap);
    float page_max = -INFINITY;
    for (int64_t j = lo; j < hi; ++j) page_max = std::max(page_max, sq[j]);
    const float new_max = std::max(row_max[qh], page_max);
    const float correction = exp_nonpositive(row_max[qh] - new_max);  // row_max = -inf: ~0
    if (S % 8 == 0) {
      for (int64_t j0 = 0; j0 < S; j0 += 8) store(sq + j0, exp_nonpositive(load(sq + j0) - new_max));
    } else {
      for (int64_t j = lo; j < hi; ++j) sq[j] = exp_nonpositive(sq[j] - new_max);
    }
    float page_sum = 0.0f;
    for (int64_t j = lo; j < hi; ++j) page_sum += sq[j];
    row_sum[qh] = row_sum[qh] * correction + page_sum;
    row_max[qh] = new_max;
    float* a = acc + qh * D;
    if (correction != 1.0f)
      for (int64_t d = 0; d < D; ++d) a[d] *= correction;
    page_values(a, sq, v_page + (qh / G) * D, lo, hi, D, ts);
  }
}

// One part of a group's KV range.  A group is the tokens whose first page is the same (a
// shared prefix: a document and the questions asked about it); at each page index every
// token of the group takes its page in turn, so a page they share comes from memory once
// and from cache for the rest.  Parts cut the group's page range evenly.
void attend_group_part(const Operands& o, const std::vector<int64_t>& members, int64_t part) {
  const int64_t QH = o.q_heads, D = o.head_dim, S = o.page_size;
  std::vector<Span> spans;
  int64_t lo_page = INT64_MAX, hi_page = 0;
  for (int64_t t : members) {
    const int64_t at = t * o.splits + part;
    std::fill(o.part_acc + at * QH * D, o.part_acc + (at + 1) * QH * D, 0.0f);
    std::fill(o.part_max + at * QH, o.part_max + (at + 1) * QH, -INFINITY);
    std::fill(o.part_sum + at * QH, o.part_sum + (at + 1) * QH, 0.0f);
    spans.push_back(span_of(o, t));
    if (spans.back().n > 0) {
      lo_page = std::min(lo_page, spans.back().first_page);
      hi_page = std::max(hi_page, spans.back().end_page);
    }
  }
  if (hi_page == 0) return;  // padding rows only
  const int64_t per_part = (hi_page - lo_page + o.splits - 1) / o.splits;
  const int64_t page_lo = lo_page + part * per_part, page_hi = std::min(hi_page, page_lo + per_part);
  const int64_t rows = int64_t(members.size());
  std::vector<float> qs(rows * QH * D), scores(QH * S);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < QH * D; ++i) qs[r * QH * D + i] = o.q[members[r] * QH * D + i] * o.sm_scale;
  for (int64_t page_index = page_lo; page_index < page_hi; ++page_index) {
    if (page_index + 1 < page_hi && spans[0].n > 0 && page_index + 1 < spans[0].end_page)
      prefetch_page(o, o.table[members[0] * o.width + page_index + 1]);  // on its way while this one is used
    for (int64_t r = 0; r < rows; ++r) {
      const Span& sp = spans[r];
      if (page_index < sp.first_page || page_index >= sp.end_page) continue;
      const int64_t t = members[r], page_pos = page_index * S;
      const int64_t page = o.table[t * o.width + page_index];
      if (page < 0 || page >= o.pages) continue;  // never for a valid table; a stray id reads nothing
      const int64_t lo = std::max(sp.first, page_pos) - page_pos, hi = std::min<int64_t>(sp.n - page_pos, S);
      attend_page(o, page, lo, hi, qs.data() + r * QH * D, scores.data(), t * o.splits + part);
    }
  }
}

// out[t] = token t's parts merged (the online-softmax combine), normalized with each
// head's sink in the denominator.
void merge_parts(const Operands& o, float* out, int64_t t) {
  const int64_t QH = o.q_heads, D = o.head_dim;
  for (int64_t qh = 0; qh < QH; ++qh) {
    float m = -INFINITY;
    for (int64_t p = 0; p < o.splits; ++p) m = std::max(m, o.part_max[(t * o.splits + p) * QH + qh]);
    float total = 0.0f;
    float* y = out + (t * QH + qh) * D;
    std::fill(y, y + D, 0.0f);
    for (int64_t p = 0; p < o.splits; ++p) {
      const int64_t at = (t * o.splits + p) * QH + qh;
      if (o.part_sum[at] == 0.0f) continue;  // an empty part (past the row's pages)
      const float w = o.splits == 1 ? 1.0f : exp_nonpositive(o.part_max[at] - m);
      total += w * o.part_sum[at];
      for (int64_t d = 0; d < D; ++d) y[d] += w * o.part_acc[at * D + d];
    }
    const float inv = sink_normalizer(m, total, o.sinks[qh]);  // total = 0 (no key): 0
    for (int64_t d = 0; d < D; ++d) y[d] *= inv;
  }
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool threads, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> pool,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> kv_len,
                           ffi::Buffer<ffi::S32> window, ffi::Buffer<ffi::F32> sinks, float sm_scale,
                           float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  PoolLayer p;
  if (ffi::Error e = pool_layer("paged_decode_attention", q, pool, layer, sinks, p); e.failure()) return e;
  const auto td = table.dimensions();
  if (td.size() != 2 || td[0] != p.tokens || kv_len.element_count() != p.tokens || window.element_count() != 1) {
    return ffi::Error::InvalidArgument("paged_decode_attention: operand shapes do not agree");
  }
  const int64_t tokens = p.tokens, q_heads = p.q_heads, head_dim = p.head_dim;
  // Groups of tokens sharing their first page (see attend_group_part), each cut into
  // enough parts that every thread has work when there are few groups (flash-decoding).
  std::vector<std::vector<int64_t>> groups;
  {
    std::vector<std::pair<int64_t, int64_t>> keyed;  // (first page, token)
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t first_page = kv_len.typed_data()[t] <= 0 ? -1 - t : table.typed_data()[t * td[1]];
      keyed.emplace_back(first_page, t);
    }
    std::sort(keyed.begin(), keyed.end());
    for (size_t i = 0; i < keyed.size(); ++i) {
      if (i == 0 || keyed[i].first != keyed[i - 1].first) groups.emplace_back();
      groups.back().push_back(keyed[i].second);
    }
  }
  const int64_t workers = std::max<int64_t>(1, threads.num_threads() + 1);
  const int64_t num_groups = std::max<int64_t>(1, int64_t(groups.size()));
  const int64_t splits = std::max<int64_t>(1, std::min<int64_t>(8, (2 * workers + num_groups - 1) / num_groups));
  std::vector<float> part_acc(tokens * splits * q_heads * head_dim), part_max(tokens * splits * q_heads),
      part_sum(tokens * splits * q_heads);
  const Operands o{tokens, q_heads, head_dim, p.pages, p.page_size, p.kv_heads, td[1], q.typed_data(), p.k, p.v,
                   table.typed_data(), kv_len.typed_data(), p.sinks, window.typed_data()[0], sm_scale, soft_cap, splits,
                   part_acc.data(), part_max.data(), part_sum.data()};
  parallel_for(threads, int64_t(groups.size()) * splits,
               [&o, &groups](int64_t item) { attend_group_part(o, groups[item / o.splits], item % o.splits); });
  float* y = out->typed_data();
  for (int64_t t = 0; t < tokens; ++t) merge_parts(o, y, t);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StrataPagedDecodeAttention, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_len
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
