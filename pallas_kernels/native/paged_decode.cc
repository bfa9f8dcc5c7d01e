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
// Work items are (group of tokens sharing their first page, part of its KV range) pairs,
// shared out over XLA's intra-op thread pool; a token's parts are merged at the end
// (flash-decoding), so one long row still keeps every core busy.  Tokens on the same
// physical page (a shared document) are scored together as one register-tiled product
// (attend_shared_run); a token alone on its page takes the matrix-vector path (attend_page).
// Vector code uses GCC/Clang vector extensions (8 floats on the matrix-vector path, the
// build's width on the tiled one), which compile to AVX on x86 and NEON pairs on ARM.
// The sinks join only the merge's final normalisation (once per token and head), so the
// page loop does no extra work.
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

// Tokens of a group on the same pages (a document several questions share): their query
// heads of one KV head sit in vector lanes and the pages' slots are scored as one
// register-tiled product (common.h's scores_tile / values_tile), instead of one
// matrix-vector product per token.  Lane i * G + g is member rows[i]'s query head
// h * G + g; each lane's online-softmax state lives where attend_page keeps it (part_max,
// part_sum, part_acc), so tokens move between the two paths page by page.  Consecutive
// pages the same members share go as one run of up to SHARED_RUN_KEYS keys, so each
// lane's accumulator is loaded and stored once per run, not once per page.
constexpr int64_t SHARED_KEY_TILE = 4;   // keys per scores tile (x 2 row vectors: 8 accumulators)
constexpr int64_t SHARED_RUN_KEYS = 96;  // keys a run aims for

struct SharedRun {
  std::vector<int64_t> rows;                         // members (indices into the group) on these pages
  std::vector<std::pair<int64_t, int64_t>> pages;    // (page, position of its slot 0)
};

struct SharedScratch {
  std::vector<int64_t> packed;  // the members whose queries qt holds (repacked when they change)
  std::vector<float> qt;        // [H][D][m_pad], scaled queries transposed
  std::vector<float> st, lo, hi, max, sum, correction, zeros, spare;
  std::vector<int64_t> key_pos;  // the run's keys' positions
  std::vector<const float*> k_rows, v_rows;
  std::vector<float*> acc_rows;
};

// A run of pages shared by members run.rows of a group (each seeing its positions
// spans[r].first .. spans[r].n - 1), every KV head, folded into their part states.  Only
// slots some member sees are read (unwritten ones may hold NaN).
void attend_shared_run(const Operands& o, const std::vector<int64_t>& members, const SharedRun& run,
                       const std::vector<Span>& spans, const float* qs, int64_t part, SharedScratch& s) {
  const int64_t QH = o.q_heads, H = o.kv_heads, D = o.head_dim, S = o.page_size, G = QH / H, ts = H * D;
  const std::vector<int64_t>& rows = run.rows;
  const int64_t m = int64_t(rows.size()) * G, m_pad = (m + VF - 1) / VF * VF;
  if (s.packed != rows) {
    s.packed = rows;
    s.qt.assign(H * D * m_pad, 0.0f);
    for (int64_t i = 0; i < int64_t(rows.size()); ++i)
      for (int64_t qh = 0; qh < QH; ++qh)
        for (int64_t e = 0; e < D; ++e)
          s.qt[((qh / G) * D + e) * m_pad + i * G + qh % G] = qs[(rows[i] * QH + qh) * D + e];
  }
  s.lo.assign(m_pad, 0.0f);
  s.hi.assign(m_pad, 0.0f);  // padding lanes see nothing
  int64_t lo_all = INT64_MAX, hi_all = 0;  // positions some member sees; every lane sees [max lo, min hi)
  int64_t lo_max = 0, hi_min = INT64_MAX;
  for (int64_t i = 0; i < int64_t(rows.size()); ++i) {
    const Span& sp = spans[rows[i]];
    lo_all = std::min(lo_all, sp.first), hi_all = std::max(hi_all, sp.n);
    lo_max = std::max(lo_max, sp.first), hi_min = std::min(hi_min, sp.n);
    for (int64_t g = 0; g < G; ++g) {
      s.lo[i * G + g] = float(sp.first);
      s.hi[i * G + g] = float(sp.n);
    }
  }
  s.key_pos.clear();
  for (const auto& [page, page_pos] : run.pages)  // the run's keys: slots some member sees
    for (int64_t pos = std::max(page_pos, lo_all); pos < std::min(page_pos + S, hi_all); ++pos)
      s.key_pos.push_back(pos);
  const int64_t keys = int64_t(s.key_pos.size());
  if (keys == 0) return;
  const bool whole = s.key_pos.front() >= lo_max && s.key_pos.back() < hi_min;  // every lane sees every key
  const int64_t tiled = (keys + SHARED_KEY_TILE - 1) / SHARED_KEY_TILE * SHARED_KEY_TILE;
  s.st.resize(tiled * m_pad);
  s.zeros.assign(D, 0.0f);
  s.spare.resize((m_pad - m) * D);  // padding lanes' accumulators, never read
  s.k_rows.resize(tiled);
  s.v_rows.resize(keys);
  s.max.resize(m_pad);
  s.sum.resize(m_pad);
  s.correction.resize(m_pad);
  s.acc_rows.resize(m_pad);
  const auto exp = [](vf x) { return exp_nonpositive_wide(x); };
  for (int64_t h = 0; h < H; ++h) {
    {
      int64_t j = 0;
      for (const auto& [page, page_pos] : run.pages) {
        const float* k_page = o.k_layer + page * S * ts + h * D;
        const float* v_page = o.v_layer + page * S * ts + h * D;
        for (; j < keys && s.key_pos[j] < page_pos + S; ++j) {
          s.k_rows[j] = k_page + (s.key_pos[j] - page_pos) * ts;
          s.v_rows[j] = v_page + (s.key_pos[j] - page_pos) * ts;
        }
      }
      for (; j < tiled; ++j) s.k_rows[j] = s.zeros.data();
    }
    for (int64_t lane = 0; lane < m_pad; ++lane) {  // the lanes' states, where attend_page keeps them
      if (lane < m) {
        const int64_t at = (members[rows[lane / G]] * o.splits + part) * QH + h * G + lane % G;
        s.max[lane] = o.part_max[at];
        s.sum[lane] = o.part_sum[at];
        s.acc_rows[lane] = o.part_acc + at * D;
      } else {
        s.max[lane] = -INFINITY;
        s.sum[lane] = 0.0f;
        s.acc_rows[lane] = s.spare.data() + (lane - m) * D;
      }
    }
    scores_tiles<SHARED_KEY_TILE>(s.qt.data() + h * D * m_pad, m_pad, s.k_rows.data(), s.st.data(), tiled, D);
    float* st = s.st.data();
    if (o.soft_cap > 0.0f)
      for (int64_t i = 0; i < keys * m_pad; ++i) st[i] = o.soft_cap * std::tanh(st[i] / o.soft_cap);
    for (int64_t r0 = 0; r0 < m_pad; r0 += VF) {  // the online softmax, a vector of lanes at a time
      const vf lo = loadf(s.lo.data() + r0), hi = loadf(s.hi.data() + r0);
      const auto sees = [&](int64_t j) {  // the key is in the lane's span
        const vf key = splatf(float(s.key_pos[j]));
        return (key >= lo) & (key < hi);
      };
      const bool all_see = whole && r0 + VF <= m;  // no padding lane in this vector either
      online_softmax_lanes(st, m_pad, r0, keys, all_see, sees, exp, s.max.data(), s.sum.data(),
                           s.correction.data());
    }
    values_tiles(st, m_pad, s.v_rows.data(), keys, s.correction.data(), s.acc_rows.data(), D);
    for (int64_t lane = 0; lane < m; ++lane) {
      const int64_t at = (members[rows[lane / G]] * o.splits + part) * QH + h * G + lane % G;
      o.part_max[at] = s.max[lane];
      o.part_sum[at] = s.sum[lane];
    }
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
  SharedScratch shared;
  SharedRun run;  // pages shared by the same members, not yet scored
  const int64_t run_pages = std::max<int64_t>(1, SHARED_RUN_KEYS / S);
  auto flush = [&]() {
    if (!run.pages.empty()) attend_shared_run(o, members, run, spans, qs.data(), part, shared);
    run.pages.clear();
  };
  std::vector<std::pair<int64_t, int64_t>> on_page;  // (page, member) of the members this page index holds
  std::vector<int64_t> same;
  const bool tiles = D % 16 == 0;  // the tiles' dims go by 16
  for (int64_t page_index = page_lo; page_index < page_hi; ++page_index) {
    if (page_index + 1 < page_hi && spans[0].n > 0 && page_index + 1 < spans[0].end_page)
      prefetch_page(o, o.table[members[0] * o.width + page_index + 1]);  // on its way while this one is used
    on_page.clear();
    for (int64_t r = 0; r < rows; ++r) {
      const Span& sp = spans[r];
      if (page_index < sp.first_page || page_index >= sp.end_page) continue;
      const int64_t page = o.table[members[r] * o.width + page_index];
      if (page < 0 || page >= o.pages) continue;  // never for a valid table; a stray id reads nothing
      on_page.emplace_back(page, r);
    }
    std::sort(on_page.begin(), on_page.end());
    const int64_t page_pos = page_index * S;
    // Members on the same physical page together.  The online softmax does not depend on
    // the order pages are folded in, so a run may wait while other members' pages go first.
    for (size_t a = 0; a < on_page.size();) {
      size_t b = a;
      same.clear();
      while (b < on_page.size() && on_page[b].first == on_page[a].first) same.push_back(on_page[b++].second);
      const int64_t page = on_page[a].first;
      if (tiles && same.size() >= 2) {
        if (run.rows != same || int64_t(run.pages.size()) >= run_pages) {
          flush();
          run.rows = same;
        }
        run.pages.emplace_back(page, page_pos);
      } else {
        for (int64_t r : same) {
          const Span& sp = spans[r];
          const int64_t lo = std::max(sp.first, page_pos) - page_pos, hi = std::min<int64_t>(sp.n - page_pos, S);
          attend_page(o, page, lo, hi, qs.data() + r * QH * D, scores.data(), members[r] * o.splits + part);
        }
      }
      a = b;
    }
  }
  flush();
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
