// forward_kvcache (kvcache_fwd) against the float64 reference: contiguous and paged caches (page
// sizes 1, 16, 64, 256), ragged cache_seqlens (0, 1, page boundaries, 64k), GQA ratios 1/4/8/32,
// seqlen_q 1/2/4/16 and chunked prefill, causal, window and softcap, forced and chosen splits,
// in-place append read back, faults reported (page ids, lengths), and a captured CUDA graph
// replayed with other lengths and block tables; and flashjit::tune on a decode shape.
#include <catch2/catch.hpp>

#include <algorithm>
#include <numeric>
#include <optional>

#include "flashjit/tuning.hpp"
#include "support/attention_case.hpp"

using namespace flashjit;
using namespace flashjit::test;

namespace {

struct KvSetup {
  int batch = 1, seqlen_q = 1, heads_q = 8, heads_kv = 2, head_dim = 128;
  std::vector<int> cache_lens;  // tokens cached per sequence before the call (size batch)
  int seqlen_new = 0;           // appended by the call
  int page_size = 0;            // 0: contiguous cache
  int capacity = 0;             // tokens per sequence the cache holds (0: the longest need)
  bool causal = false;
  int window_left = -1, window_right = -1;
  float softcap = 0.f;
  int num_splits = 0;
  bool pass_seqlens = true;     // false: no cache_seqlens (every sequence fills the cache)
  DType dtype = DType::bf16;
  std::optional<KernelSpec> kernel;  // forced (options.kernel), else dispatch's

  std::string describe() const {
    std::ostringstream s;
    s << "batch " << batch << " seqlen_q " << seqlen_q << " heads " << heads_q << "/" << heads_kv << " d " << head_dim
      << " page_size " << page_size << " capacity " << capacity << " new " << seqlen_new << " splits " << num_splits
      << (causal ? " causal" : "") << " window (" << window_left << ", " << window_right << ") softcap " << softcap
      << (dtype == DType::bf16 ? " bf16" : " fp16") << (kernel ? " kernel " + kernel->name() : "") << " cache_lens";
    for (int l : cache_lens) s << " " << l;
    return s.str();
  }
};

ScalarType scalar(DType d) { return d == DType::bf16 ? ScalarType::bfloat16 : ScalarType::float16; }

// One case: logical K/V per sequence, scattered into a cache (pages in a shuffled order, unused
// slots NaN so a read past a sequence's end shows), the call, and its checks.
class KvCase {
 public:
  KvCase(KvSetup s, uint64_t seed) : s_(std::move(s)), rng_(seed) {
    if (s_.cache_lens.empty()) s_.cache_lens.assign(s_.batch, 64);
    int longest = 0;
    for (int l : s_.cache_lens) longest = std::max(longest, l + s_.seqlen_new);
    if (s_.capacity == 0) s_.capacity = std::max(1, longest);
    if (s_.page_size > 0) s_.capacity = (s_.capacity + s_.page_size - 1) / s_.page_size * s_.page_size;
    const int d = s_.head_dim;
    fill_rounded(rng_, s_.dtype, size_t(s_.batch) * s_.seqlen_q * s_.heads_q * d, q_bits_, q_);
    // Logical keys of sequence b: its cache_lens[b] cached tokens, then the new ones.
    for (int b = 0; b < s_.batch; ++b) {
      const int length = s_.pass_seqlens ? s_.cache_lens[b] + s_.seqlen_new : s_.capacity;
      seqlens_k_.push_back(length);
    }
    const size_t total_k = std::accumulate(seqlens_k_.begin(), seqlens_k_.end(), size_t(0));
    fill_rounded(rng_, s_.dtype, total_k * s_.heads_kv * d, k_bits_, k_);
    fill_rounded(rng_, s_.dtype, total_k * s_.heads_kv * d, v_bits_, v_);
    build_cache();
  }

  // New inputs and lengths for the same shapes and capacity, uploaded into the same device buffers
  // (what a captured graph reads).
  void regenerate(const std::vector<int>& cache_lens, uint64_t seed) {
    rng_.seed(seed);
    s_.cache_lens = cache_lens;
    seqlens_k_.clear();
    k_new_.clear();
    v_new_.clear();
    const int d = s_.head_dim;
    fill_rounded(rng_, s_.dtype, size_t(s_.batch) * s_.seqlen_q * s_.heads_q * d, q_bits_, q_);
    for (int b = 0; b < s_.batch; ++b) seqlens_k_.push_back(s_.cache_lens[b] + s_.seqlen_new);
    const size_t total_k = std::accumulate(seqlens_k_.begin(), seqlens_k_.end(), size_t(0));
    fill_rounded(rng_, s_.dtype, total_k * s_.heads_kv * d, k_bits_, k_);
    fill_rounded(rng_, s_.dtype, total_k * s_.heads_kv * d, v_bits_, v_);
    build_cache();
    upload();
  }

  // Page ids per (sequence, slot), shuffled; unused block-table columns hold an id far out of
  // range, which the kernels must never read.
  void build_cache() {
    const int d = s_.head_dim, h = s_.heads_kv;
    const size_t row = size_t(h) * d;
    if (s_.page_size > 0) {
      max_pages_ = s_.capacity / s_.page_size;
      num_pages_ = s_.batch * max_pages_ + 3;  // spare pages stay NaN
      std::vector<int> ids(num_pages_);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng_);
      block_table_.assign(size_t(s_.batch) * max_pages_, 1 << 30);
      for (int b = 0; b < s_.batch; ++b) {
        const int used = (seqlens_k_[b] + s_.page_size - 1) / s_.page_size;
        for (int i = 0; i < used; ++i) block_table_[size_t(b) * max_pages_ + i] = ids[size_t(b) * max_pages_ + i];
      }
      cache_rows_ = size_t(num_pages_) * s_.page_size;
    } else {
      cache_rows_ = size_t(s_.batch) * s_.capacity;
    }
    k_cache_.assign(cache_rows_ * row, 0xffff);
    v_cache_.assign(cache_rows_ * row, 0xffff);
    size_t k_row0 = 0;
    for (int b = 0; b < s_.batch; ++b) {
      const int cached = s_.pass_seqlens ? s_.cache_lens[b] : s_.capacity;
      for (int t = 0; t < seqlens_k_[b]; ++t) {
        const size_t src = (k_row0 + t) * row;
        if (t < cached) {
          const size_t dst = cache_row(b, t) * row;
          std::copy_n(&k_bits_[src], row, &k_cache_[dst]);
          std::copy_n(&v_bits_[src], row, &v_cache_[dst]);
        } else {  // appended by the call
          k_new_.insert(k_new_.end(), &k_bits_[src], &k_bits_[src] + row);
          v_new_.insert(v_new_.end(), &v_bits_[src], &v_bits_[src] + row);
        }
      }
      k_row0 += seqlens_k_[b];
    }
    // k_new/v_new were gathered per sequence in order: (batch, seqlen_new, heads_kv, d).
  }

  size_t cache_row(int b, int t) const {
    if (s_.page_size == 0) return size_t(b) * s_.capacity + t;
    return size_t(block_table_[size_t(b) * max_pages_ + t / s_.page_size]) * s_.page_size + t % s_.page_size;
  }

  // Device buffers made on the first upload and reused (same sizes) after.
  void upload() {
    if (!q_dev_) allocate();
    q_dev_->upload(q_bits_);
    k_cache_dev_->upload(k_cache_);
    v_cache_dev_->upload(v_cache_);
    seqlens_dev_->upload(s_.cache_lens);
    if (table_dev_) table_dev_->upload(block_table_);
    if (k_new_dev_) {
      k_new_dev_->upload(k_new_);
      v_new_dev_->upload(v_new_);
    }
  }

  void allocate() {
    const size_t row = size_t(s_.heads_kv) * s_.head_dim;
    q_dev_ = std::make_unique<DeviceBuffer>(q_bits_.size() * 2);
    out_dev_ = std::make_unique<DeviceBuffer>(q_bits_.size() * 2);
    lse_dev_ = std::make_unique<DeviceBuffer>(size_t(s_.batch) * s_.heads_q * s_.seqlen_q * 4);
    k_cache_dev_ = std::make_unique<DeviceBuffer>(cache_rows_ * row * 2);
    v_cache_dev_ = std::make_unique<DeviceBuffer>(cache_rows_ * row * 2);
    seqlens_dev_ = std::make_unique<DeviceBuffer>(size_t(s_.batch) * 4);
    if (s_.page_size > 0) table_dev_ = std::make_unique<DeviceBuffer>(block_table_.size() * 4);
    if (s_.seqlen_new > 0) {
      k_new_dev_ = std::make_unique<DeviceBuffer>(k_new_.size() * 2);
      v_new_dev_ = std::make_unique<DeviceBuffer>(v_new_.size() * 2);
    }
  }

  // The tensors of one call, views over the device buffers.
  struct Views {
    TensorView q, out, lse, k_cache, v_cache, table, seqlens, k_new, v_new;
    KvCache cache;
  };
  Views views() const {
    Views v;
    const ScalarType t = scalar(s_.dtype);
    const int64_t rows_per_page = s_.page_size > 0 ? s_.page_size : s_.capacity;
    const int64_t pages = s_.page_size > 0 ? num_pages_ : s_.batch;
    v.q = TensorView::contiguous(q_dev_->get(), t, {s_.batch, s_.seqlen_q, s_.heads_q, s_.head_dim});
    v.out = TensorView::contiguous(out_dev_->get(), t, {s_.batch, s_.seqlen_q, s_.heads_q, s_.head_dim});
    v.lse = TensorView::contiguous(lse_dev_->get(), ScalarType::float32, {s_.batch, s_.heads_q, s_.seqlen_q});
    v.k_cache = TensorView::contiguous(k_cache_dev_->get(), t, {pages, rows_per_page, s_.heads_kv, s_.head_dim});
    v.v_cache = TensorView::contiguous(v_cache_dev_->get(), t, {pages, rows_per_page, s_.heads_kv, s_.head_dim});
    v.cache.k_cache = v.k_cache;
    v.cache.v_cache = v.v_cache;
    v.seqlens = TensorView::contiguous(seqlens_dev_->get(), ScalarType::int32, {s_.batch});
    if (s_.pass_seqlens) v.cache.cache_seqlens = &v.seqlens;
    if (s_.page_size > 0) {
      v.table = TensorView::contiguous(table_dev_->get(), ScalarType::int32, {s_.batch, max_pages_});
      v.cache.block_table = &v.table;
    }
    if (s_.seqlen_new > 0) {
      v.k_new = TensorView::contiguous(k_new_dev_->get(), t, {s_.batch, s_.seqlen_new, s_.heads_kv, s_.head_dim});
      v.v_new = TensorView::contiguous(v_new_dev_->get(), t, {s_.batch, s_.seqlen_new, s_.heads_kv, s_.head_dim});
      v.cache.k_new = &v.k_new;
      v.cache.v_new = &v.v_new;
    }
    return v;
  }

  AttentionOptions options() const {
    AttentionOptions o;
    o.causal = s_.causal;
    o.window_left = s_.window_left;
    o.window_right = s_.window_right;
    o.softcap = s_.softcap;
    o.num_splits = s_.num_splits;
    o.kernel = s_.kernel;
    return o;
  }

  // Poisons out and lse, runs the call on the legacy stream and waits.
  void run() {
    if (!q_dev_) upload();
    out_dev_->poison();
    lse_dev_->poison();
    Views v = views();
    test_runtime().forward_kvcache(v.q, v.cache, v.out, &v.lse, options());
    synchronize();
    CaseLedger::get().ran(Family::kvcache_fwd);
  }

  // out and lse against the float64 reference over each sequence's keys (cached and new).
  void check_outputs() {
    AttentionShape shape = AttentionShape::make(s_.batch, s_.seqlen_q, 0, s_.heads_q, s_.heads_kv, s_.head_dim);
    shape.seqlens_q.assign(s_.batch, s_.seqlen_q);
    shape.seqlens_k = seqlens_k_;
    shape.causal = s_.causal;
    shape.window_left = s_.window_left;
    shape.window_right = s_.window_right;
    shape.softcap = s_.softcap;
    std::vector<double> want_out, want_lse, magnitude;
    reference_attention(shape, q_, k_, v_, want_out, want_lse, &magnitude);
    const auto got_out = out_dev_->download<uint16_t>();
    const auto got_lse = lse_dev_->download<float>();
    INFO(s_.describe());
    const Comparison out = compare_output(shape, s_.dtype, got_out, want_out, magnitude,
                                          tensor_core_output_tolerance(s_.dtype));
    INFO("out: " << out.bad << " of " << out.checked << " bad; first " << out.first_bad << "; worst "
                 << out.worst_head << " at " << out.worst_head_rms);
    CHECK(out.ok());
    Comparison lse;
    const int total_q = s_.batch * s_.seqlen_q;
    for (int b = 0; b < s_.batch; ++b)
      for (int h = 0; h < s_.heads_q; ++h)
        for (int i = 0; i < s_.seqlen_q; ++i)
          compare(lse, got_lse[(size_t(b) * s_.heads_q + h) * s_.seqlen_q + i],
                  want_lse[size_t(h) * total_q + b * s_.seqlen_q + i], tensor_core_lse_tolerance(),
                  [&] { return "lse[" + std::to_string(b) + ", " + std::to_string(h) + ", " + std::to_string(i) + "]"; });
    INFO("lse: " << lse.bad << " bad; first " << lse.first_bad);
    CHECK(lse.ok());
  }

  // The cache after the call: every slot as before, the appended tokens at cache_seqlens.
  void check_cache_after_append() const {
    auto expected_k = k_cache_, expected_v = v_cache_;
    const size_t row = size_t(s_.heads_kv) * s_.head_dim;
    for (int b = 0; b < s_.batch; ++b)
      for (int t = 0; t < s_.seqlen_new; ++t) {
        const size_t dst = cache_row(b, s_.cache_lens[b] + t) * row, src = (size_t(b) * s_.seqlen_new + t) * row;
        std::copy_n(&k_new_[src], row, &expected_k[dst]);
        std::copy_n(&v_new_[src], row, &expected_v[dst]);
      }
    INFO(s_.describe());
    CHECK(k_cache_dev_->download<uint16_t>() == expected_k);
    CHECK(v_cache_dev_->download<uint16_t>() == expected_v);
  }

  std::vector<uint16_t> output_bits() const { return out_dev_->download<uint16_t>(); }
  KvSetup& setup() { return s_; }
  std::vector<int>& block_table() { return block_table_; }
  DeviceBuffer& out_buffer() { return *out_dev_; }
  DeviceBuffer& lse_buffer() { return *lse_dev_; }
  DeviceBuffer& table_buffer() { return *table_dev_; }
  DeviceBuffer& seqlens_buffer() { return *seqlens_dev_; }

 private:
  KvSetup s_;
  std::mt19937_64 rng_;
  std::vector<uint16_t> q_bits_, k_bits_, v_bits_, k_cache_, v_cache_, k_new_, v_new_;
  std::vector<double> q_, k_, v_;
  std::vector<int> seqlens_k_, block_table_;
  int max_pages_ = 0, num_pages_ = 0;
  size_t cache_rows_ = 0;
  std::unique_ptr<DeviceBuffer> q_dev_, out_dev_, lse_dev_, k_cache_dev_, v_cache_dev_, seqlens_dev_, table_dev_,
      k_new_dev_, v_new_dev_;
};

void check_case(const KvSetup& s, uint64_t seed) {
  KvCase c(s, seed);
  c.run();
  c.check_outputs();
  if (s.seqlen_new > 0) c.check_cache_after_append();
  CHECK_NOTHROW(test_runtime().check_kvcache());
}

}  // namespace

TEST_CASE("kvcache: decode over contiguous and paged caches, ragged lengths", "[kvcache][quick]") {
  // Lengths: empty, one token, page boundaries either side, a long one.
  const std::vector<int> lens{0, 1, 15, 16, 17, 64, 255, 1000};
  for (int page_size : {0, 1, 16, 64, 256}) {
    KvSetup s;
    s.batch = static_cast<int>(lens.size());
    s.cache_lens = lens;
    s.page_size = page_size;
    s.heads_q = 8;
    s.heads_kv = 2;
    check_case(s, 100 + page_size);
  }
}

TEST_CASE("kvcache: GQA ratios and query lengths, forced and chosen splits", "[kvcache][quick]") {
  int seed = 200;
  for (int ratio : {1, 4, 8, 32})
    for (int seqlen_q : {1, 2, 4, 16}) {
      KvSetup s;
      s.batch = 3;
      s.heads_q = 32;
      s.heads_kv = 32 / ratio;
      s.seqlen_q = seqlen_q;
      s.cache_lens = std::vector<int>{700, 33, 2048};
      s.page_size = ratio == 4 ? 16 : 0;
      s.num_splits = seqlen_q == 2 ? 1 : seqlen_q == 4 ? 5 : 0;
      s.causal = seqlen_q > 1 && ratio != 8;  // speculative verification: each draft token sees its prefix
      check_case(s, seed++);
    }
}

TEST_CASE("kvcache: masks, softcap, head dims and fp16", "[kvcache]") {
  int seed = 300;
  for (int head_dim : {64, 80, 96, 128, 256})  // 80 runs on the d96 kernel: padding columns
    for (DType dtype : {DType::bf16, DType::fp16}) {
      KvSetup s;
      s.dtype = dtype;
      s.head_dim = head_dim;
      s.batch = 2;
      s.seqlen_q = 4;
      s.heads_q = 8;
      s.heads_kv = 1;
      s.cache_lens = std::vector<int>{1500, 129};
      s.page_size = 64;
      s.causal = true;
      check_case(s, seed++);
      s.causal = false;
      s.window_left = 100;
      s.window_right = 0;
      s.softcap = 30.f;
      s.num_splits = 3;
      check_case(s, seed++);
      s.window_left = 40;
      s.window_right = 2;
      s.softcap = 0.f;
      s.page_size = 0;
      check_case(s, seed++);
    }
}

// Head dim 256 with 33-64 packed rows: the widest tile dispatch fits (64 rows x 32 keys since 64 x
// 64 spilled), through the cp.async entry, with each mask.
TEST_CASE("kvcache: head dim 256 at 64 packed rows", "[kvcache]") {
  int seed = 350;
  for (MaskKind mask : {MaskKind::none, MaskKind::causal, MaskKind::window}) {
    KvSetup s;
    s.head_dim = 256;
    s.batch = 2;
    s.seqlen_q = 8;
    s.heads_q = 16;
    s.heads_kv = 2;  // 8 queries x a group of 8: 64 packed rows
    s.cache_lens = std::vector<int>{900, 77};
    s.page_size = mask == MaskKind::causal ? 16 : 0;
    s.causal = mask == MaskKind::causal;
    if (mask == MaskKind::window) {
      s.window_left = 100;
      s.window_right = 0;
    }
    check_case(s, seed++);
  }
}

TEST_CASE("kvcache: append new tokens in place, then attend over them", "[kvcache][quick]") {
  int seed = 400;
  for (int page_size : {0, 1, 16, 64})
    for (int seqlen_new : {1, 3}) {
      KvSetup s;
      s.batch = 4;
      s.seqlen_q = seqlen_new;
      s.seqlen_new = seqlen_new;
      s.cache_lens = std::vector<int>{0, 15, 63, 300};  // new tokens start a page, cross one, fill one
      s.page_size = page_size;
      s.causal = true;
      s.heads_q = 16;
      s.heads_kv = 4;
      s.capacity = 320;
      check_case(s, seed++);
    }
}

TEST_CASE("kvcache: a 64k cache, and no cache_seqlens", "[kvcache]") {
  KvSetup s;
  s.batch = 2;
  s.heads_q = 8;
  s.heads_kv = 1;
  s.cache_lens = std::vector<int>{65536, 3};
  s.page_size = 16;
  check_case(s, 500);
  KvSetup full;
  full.batch = 2;
  full.capacity = 777;
  full.cache_lens = std::vector<int>{0, 0};
  full.pass_seqlens = false;
  check_case(full, 501);
}

TEST_CASE("kvcache: chunked prefill against a paged cache", "[kvcache][quick]") {
  KvSetup s;
  s.batch = 2;
  s.seqlen_q = 100;
  s.seqlen_new = 100;
  s.heads_q = 8;
  s.heads_kv = 2;
  s.cache_lens = std::vector<int>{300, 0};
  s.page_size = 16;
  s.causal = true;
  check_case(s, 600);
  s.page_size = 0;
  s.seqlen_new = 0;
  s.seqlen_q = 37;
  s.causal = false;
  check_case(s, 601);
}

TEST_CASE("kvcache: splits merge in a fixed order", "[kvcache][quick]") {
  // On sm_90, 7 and 16 merge inside a cluster (16: the non-portable size); 77 takes the combine,
  // whose lanes take the splits in chunks of 32.
  for (int splits : {7, 16, 77}) {
    KvSetup s;
    s.batch = 2;
    s.heads_q = 8;
    s.heads_kv = 2;
    s.cache_lens = std::vector<int>{5000, 4000};
    s.page_size = 16;
    s.num_splits = splits;
    KvCase c(s, 700 + splits);
    c.run();
    c.check_outputs();
    const auto first = c.output_bits();
    c.run();
    CHECK(c.output_bits() == first);  // bitwise on a rerun
  }
}

// Which merge a split call ran, seen in what a capture of it records: on sm_90 up to 16 splits merge
// inside their cluster (the attention kernel alone), more take the workspace and the combine (an
// allocation, the attention, the combine, the free); elsewhere every split count does.
TEST_CASE("kvcache: on sm_90 a row's splits merge inside their cluster, with no second kernel", "[kvcache][quick]") {
  const bool hopper = device_properties(0).arch().name() == "sm_90a";
  if (!hopper) WARN("no sm_90 device: every split count takes the combine");
  for (int splits : {2, 16, 17}) {
    KvSetup s;
    s.batch = 2;
    s.heads_q = 16;
    s.heads_kv = 2;
    s.cache_lens = std::vector<int>{3000, 2500};
    s.page_size = 64;
    s.num_splits = splits;
    KvCase c(s, 1100 + splits);
    c.run();  // compiles and loads the kernel before the capture
    c.check_outputs();
    CUstream stream = nullptr;
    FLASHJIT_CU(cuStreamCreate, &stream, CU_STREAM_NON_BLOCKING);
    AttentionOptions options = c.options();
    options.stream = stream;
    const auto v = c.views();
    CUgraph graph = nullptr;
    FLASHJIT_CU(cuStreamBeginCapture, stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
    test_runtime().forward_kvcache(v.q, v.cache, v.out, &v.lse, options);
    FLASHJIT_CU(cuStreamEndCapture, stream, &graph);
    size_t nodes = 0;
    FLASHJIT_CU(cuGraphGetNodes, graph, nullptr, &nodes);
    INFO(splits << " splits");
    CHECK(nodes == (hopper && splits <= 16 ? 1u : 4u));
    CUgraphExec exec = nullptr;
    FLASHJIT_CU(cuGraphInstantiateWithFlags, &exec, graph, 0);
    c.out_buffer().poison();
    c.lse_buffer().poison();
    FLASHJIT_CU(cuGraphLaunch, exec, stream);
    FLASHJIT_CU(cuStreamSynchronize, stream);
    c.check_outputs();
    FLASHJIT_CU(cuGraphExecDestroy, exec);
    FLASHJIT_CU(cuGraphDestroy, graph);
    FLASHJIT_CU(cuStreamDestroy, stream);
  }
}

TEST_CASE("kvcache: faults are reported, never read through", "[kvcache][quick]") {
  KvSetup s;
  s.batch = 2;
  s.cache_lens = std::vector<int>{40, 50};
  s.page_size = 16;
  KvCase c(s, 800);
  c.run();
  c.check_outputs();
  // A page id past the cache in sequence 1.
  auto table = c.block_table();
  const int max_pages = static_cast<int>(table.size() / 2);
  table[max_pages + 1] = 1 << 20;
  c.table_buffer().upload(table);
  c.run();
  try {
    test_runtime().check_kvcache();
    FAIL("a bad page id was not reported");
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find("block_table[1][1] is 1048576") != std::string::npos);
  }
  const auto out = c.output_bits();
  const size_t per_sequence = out.size() / 2;
  CHECK(std::all_of(out.begin() + per_sequence, out.end(), [](uint16_t bits) {
    return std::isnan(bf16_to_float(bits));
  }));
  CHECK_NOTHROW(test_runtime().check_kvcache());  // cleared by the check
  // A length past the cache.
  c.table_buffer().upload(c.block_table());
  c.seqlens_buffer().upload(std::vector<int>{40, 100000});
  c.run();
  CHECK_THROWS_WITH(test_runtime().check_kvcache(), Catch::Contains("cache_seqlens[1] is 100000"));
}

TEST_CASE("kvcache: bad arguments name what is wrong", "[kvcache][quick]") {
  KvSetup s;
  s.batch = 2;
  s.page_size = 16;
  KvCase c(s, 900);
  c.run();
  auto v = c.views();
  auto expect = [&](const KvCache& cache, const char* what) {
    CHECK_THROWS_WITH(test_runtime().forward_kvcache(v.q, cache, v.out, &v.lse), Catch::Contains(what));
  };
  TensorView short_table = v.table;
  short_table.shape[0] = 1;
  KvCache bad = v.cache;
  bad.block_table = &short_table;
  expect(bad, "block_table: 1 rows, but q has batch 2");
  TensorView float_table = v.table;
  float_table.dtype = ScalarType::float32;
  bad = v.cache;
  bad.block_table = &float_table;
  expect(bad, "block_table: expected dtype int32");
  TensorView wrong_heads = v.v_cache;
  wrong_heads.shape[2] = 3;
  bad = v.cache;
  bad.v_cache = wrong_heads;
  expect(bad, "v_cache: expected shape");
  bad = v.cache;
  bad.k_new = &v.q;
  expect(bad, "without v");
}

TEST_CASE("kvcache: a decode step captured in a CUDA graph replays with new lengths", "[kvcache][quick]") {
  KvSetup s;
  s.batch = 3;
  s.seqlen_q = 1;
  s.seqlen_new = 1;
  s.heads_q = 16;
  s.heads_kv = 2;
  s.page_size = 16;
  s.cache_lens = std::vector<int>{10, 31, 500};
  s.capacity = 640;
  s.causal = true;
  KvCase c(s, 1000);
  c.run();  // compiles and loads the kernel before the capture
  c.check_outputs();
  CUstream stream = nullptr;
  FLASHJIT_CU(cuStreamCreate, &stream, CU_STREAM_NON_BLOCKING);
  const auto v = c.views();
  AttentionOptions options = c.options();
  options.stream = stream;
  CUgraph graph = nullptr;
  CUgraphExec exec = nullptr;
  // Global mode: any call the runtime makes that is unsafe during a capture fails it.
  FLASHJIT_CU(cuStreamBeginCapture, stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
  test_runtime().forward_kvcache(v.q, v.cache, v.out, &v.lse, options);
  FLASHJIT_CU(cuStreamEndCapture, stream, &graph);
  FLASHJIT_CU(cuGraphInstantiateWithFlags, &exec, graph, 0);
  // Each replay: new data, lengths and page order in the captured buffers, then the graph.
  int seed = 1001;
  for (const std::vector<int>& lens : {std::vector<int>{0, 200, 17}, std::vector<int>{600, 1, 64}, std::vector<int>{15, 16, 47}}) {
    c.regenerate(lens, seed++);
    c.out_buffer().poison();
    c.lse_buffer().poison();
    FLASHJIT_CU(cuGraphLaunch, exec, stream);
    FLASHJIT_CU(cuStreamSynchronize, stream);
    c.check_outputs();
    c.check_cache_after_append();
  }
  CHECK_NOTHROW(test_runtime().check_kvcache());
  FLASHJIT_CU(cuGraphExecDestroy, exec);
  FLASHJIT_CU(cuGraphDestroy, graph);
  FLASHJIT_CU(cuStreamDestroy, stream);
}

TEST_CASE("kvcache: flashjit::tune picks a decode spec that is correct and no slower than the heuristic's",
          "[kvcache][tune]") {
  TuneShape shape;
  shape.kvcache = true;
  shape.batch = 2;
  shape.seqlen_q = 1;
  shape.seqlen_k = 3000;
  shape.heads_q = 16;
  shape.heads_kv = 4;
  shape.head_dim = 64;
  TuneOptions options;
  options.iters = 5;
  options.finalists = 2;
  const TuneResult r = tune(test_runtime(), shape, options);
  INFO(shape.describe() << ": " << r.entry.spec.name() << " " << r.entry.median_ms << " ms, heuristic "
                        << r.heuristic_ms << " ms");
  CHECK(r.timed >= 2);
  CHECK(r.entry.spec.family == Family::kvcache_fwd);
  CHECK(r.entry.problem.family == Family::kvcache_fwd);
  CHECK(r.entry.problem.query_rows_bucket == 16);  // one query of a group of 4
  REQUIRE(r.heuristic_ms > 0);
  CHECK(r.entry.median_ms <= r.heuristic_ms);
  // The winner on the tuned shape, against float64 (the tuner's own check compares it with the
  // reference kernel only within its tolerance).
  KvSetup s;
  s.batch = shape.batch;
  s.heads_q = shape.heads_q;
  s.heads_kv = shape.heads_kv;
  s.head_dim = shape.head_dim;
  s.cache_lens.assign(s.batch, shape.seqlen_k);
  s.pass_seqlens = false;
  s.kernel = r.entry.spec;
  check_case(s, 900);
}
