// forward_kvcache's host side without a GPU: argument checks (each names what is wrong), the split
// choice, and the kvcache_fwd specs dispatch and flashjit-warm's preset pick.
#include <catch2/catch.hpp>

#include "families/kvcache_fwd.hpp"
#include "flashjit/codegen/render.hpp"
#include "flashjit/dispatch.hpp"
#include "problem.hpp"

using namespace flashjit;

namespace {

// Views over a fake, aligned device address: the checks here run before any pointer is touched.
void* fake(size_t offset = 0) { return reinterpret_cast<void*>(uintptr_t(1) << 32 | offset); }

struct Paged {
  TensorView q = TensorView::contiguous(fake(), ScalarType::bfloat16, {2, 1, 8, 128});
  TensorView out = TensorView::contiguous(fake(), ScalarType::bfloat16, {2, 1, 8, 128});
  TensorView table = TensorView::contiguous(fake(), ScalarType::int32, {2, 4});
  TensorView seqlens = TensorView::contiguous(fake(), ScalarType::int32, {2});
  TensorView k_new = TensorView::contiguous(fake(), ScalarType::bfloat16, {2, 1, 2, 128});
  KvCache cache;
  Paged() {
    cache.k_cache = TensorView::contiguous(fake(), ScalarType::bfloat16, {16, 16, 2, 128});
    cache.v_cache = cache.k_cache;
    cache.block_table = &table;
    cache.cache_seqlens = &seqlens;
  }
  detail::KvCacheProblem problem() const { return detail::make_kvcache_problem(q, cache, out, nullptr, {}); }
};

}  // namespace

TEST_CASE("kvcache: a paged problem's addressing", "[api]") {
  Paged p;
  const auto problem = p.problem();
  CHECK(problem.is_paged);
  CHECK(problem.params.page_size == 16);
  CHECK(problem.params.num_pages == 16);
  CHECK(problem.params.capacity == 64);  // 4 pages of 16 per sequence
  CHECK(problem.forward.seqlen_k == 64);
  CHECK(problem.params.k_page_stride == 16 * 2 * 128);
  CHECK(problem.params.fwd.k_row_stride == 2 * 128);
  CHECK(problem.params.fwd.k_head_stride == 128);
}

TEST_CASE("kvcache: the page index is an exact division by the page size", "[api]") {
  // The kernels compute pos / page_size as (umulhi(pos, magic) + pos) >> shift (kvcache_fwd.cuh).
  for (int page_size : {1, 2, 3, 7, 16, 17, 64, 100, 256, 1000, 4096, 65536, 1 << 20}) {
    Paged p;
    p.cache.k_cache.shape[1] = p.cache.v_cache.shape[1] = page_size;
    p.cache.k_cache.strides[0] = p.cache.v_cache.strides[0] = int64_t(page_size) * 2 * 128;
    const auto problem = p.problem();
    const uint64_t magic = problem.params.page_size_magic;
    const int shift = problem.params.page_size_shift;
    INFO("page_size " << page_size);
    for (uint32_t pos : {0u, 1u, 15u, 16u, 17u, 1000u, 65535u, 65536u, 1u << 24, (1u << 31) - 1})
      for (uint32_t n : {pos, pos + uint32_t(page_size) - 1, pos * uint32_t(page_size) % (1u << 31)}) {
        if (n >= (1u << 31)) continue;
        const uint32_t high = static_cast<uint32_t>((uint64_t(n) * magic) >> 32);
        CHECK(((high + n) >> shift) == n / uint32_t(page_size));
      }
  }
}

TEST_CASE("kvcache: bad arguments name the argument and what was expected", "[api]") {
  auto fails_with = [](const Paged& p, const char* what) {
    CHECK_THROWS_WITH(p.problem(), Catch::Contains(what) && Catch::Contains("forward_kvcache"));
  };
  {
    Paged p;
    p.table.shape[0] = 3;
    fails_with(p, "block_table: 3 rows, but q has batch 2");
  }
  {
    Paged p;
    p.table.dtype = ScalarType::float32;
    fails_with(p, "block_table: expected dtype int32, got float32");
  }
  {
    Paged p;
    p.seqlens.shape[0] = 5;
    fails_with(p, "cache_seqlens: 5 entries, but q has batch 2");
  }
  {
    Paged p;
    p.cache.v_cache.shape[2] = 4;
    fails_with(p, "v_cache: expected shape (16, 16, 2, 128)");
  }
  {
    Paged p;
    p.cache.k_cache.dtype = ScalarType::float16;
    fails_with(p, "k_cache: dtype float16 differs from q's bfloat16");
  }
  {
    Paged p;
    p.q.shape[2] = 3;
    fails_with(p, "heads_kv 2 must divide heads_q 3");
  }
  {
    Paged p;
    p.cache.k_new = &p.k_new;
    fails_with(p, "k is given without v");
  }
  {
    Paged p;
    p.cache.k_new = p.cache.v_new = &p.k_new;
    p.cache.cache_seqlens = nullptr;
    fails_with(p, "appending new tokens needs cache_seqlens");
  }
  {
    Paged p;
    p.cache.k_cache.shape[1] = p.cache.v_cache.shape[1] = 0;
    fails_with(p, "page_size must be at least 1");
  }
  {
    Paged p;  // a contiguous cache holds one sequence per row
    p.cache.block_table = nullptr;
    fails_with(p, "k_cache: batch 16 differs from q's 2");
  }
  {
    Paged p;
    p.cache.k_cache.strides[2] = 130;
    fails_with(p, "k_cache: stride 130 of dim 2 is not a multiple of 8");
  }
}

TEST_CASE("kvcache: splits spread a few CTAs over the SMs, no further", "[dispatch]") {
  using detail::choose_kv_splits;
  // H200, the decode tile at head dim 128: 2 CTAs per SM, 132 SMs; 64-key tiles of 32 KB (K and V);
  // no merge inside clusters (an sm_80 build).
  const detail::KvSplitSlots h200{132, 2, {}};
  CHECK(choose_kv_splits(8, h200, 16, 32768, true, 0).count == 16);      // batch 1, 8 KV heads, 1k keys: a tile per CTA
  CHECK(choose_kv_splits(8, h200, 1024, 32768, true, 0).count == 16);    // batch 1, 64k keys: 128 CTAs, not the 264 slots
  CHECK(choose_kv_splits(16, h200, 1024, 32768, true, 0).count == 8);    // batch 2
  CHECK(choose_kv_splits(128, h200, 16, 32768, true, 0).count == 1);     // batch 16, 1k keys: 128 CTAs keep HBM busy
  CHECK(choose_kv_splits(128, h200, 1024, 32768, true, 0).count == 1);   // batch 16, 64k keys: as many CTAs as SMs
  CHECK(choose_kv_splits(512, h200, 64, 32768, true, 0).count == 1);     // batch 64: enough CTAs already
  CHECK(choose_kv_splits(8, h200, 1, 32768, true, 0).count == 1);        // one tile: nothing to split
  CHECK(choose_kv_splits(128, h200, 256, 32768, false, 0).count == 2);   // batch 16, 16k keys in pages of 16: slower CTAs
  CHECK(choose_kv_splits(8, h200, 64, 32768, false, 0).count == 16);     // batch 1, 4k keys in pages of 16: not 32
  CHECK(choose_kv_splits(128, h200, 64, 32768, false, 0).count == 1);    // batch 16, 4k keys in pages of 16 (4104 GB/s, 2: 3969)
  CHECK(choose_kv_splits(8, h200, 64, 32768, true, 7).count == 7);       // forced
  CHECK(choose_kv_splits(8, h200, 3, 32768, true, 50).count == 3);       // forced, at most one tile per split
  // The H200 building the decode tile for sm_90a: clusters of s splits, one CTA per SM, merge
  // inside (the clusters it holds at once of each size, FLASHJIT_VERBOSE on the H200).
  detail::KvSplitSlots h200_clusters = h200;
  const int clusters_at_once[] = {0, 0, 66, 39, 30, 22, 17, 15, 15, 9, 7, 7, 7, 7, 7, 7, 7};
  for (int s = 2; s <= detail::kMaxClusterCtas; ++s) h200_clusters.cluster_ctas[s] = s * clusters_at_once[s];
  auto picks = [&](long long ctas, int tiles, bool whole_tiles, int requested, int count, bool in_cluster) {
    const detail::KvSplits splits = choose_kv_splits(ctas, h200_clusters, tiles, 32768, whole_tiles, requested);
    INFO(ctas << " CTAs, " << tiles << " tiles, requested " << requested);
    CHECK(splits.count == count);
    CHECK(splits.in_cluster == in_cluster);
  };
  picks(8, 16, true, 0, 8, true);       // batch 1 x 1k: 8 splits in clusters (605 GB/s; 16 and the combine 545)
  picks(8, 64, true, 0, 8, true);       // batch 1 x 4k
  picks(8, 1024, true, 0, 16, false);   // batch 1 x 64k: 8 clusters of 16 take two waves (7 at once): the combine
  picks(16, 256, true, 0, 6, true);     // batch 2 x 16k: 16 clusters of 6 in one wave (17 at once)
  picks(128, 16, true, 0, 1, false);    // batch 16 x 1k: no split
  picks(8, 1024, true, 16, 16, false);  // forced 16 at batch 1: the combine, for the same reason
  picks(4, 47, true, 16, 16, true);     // forced 16 over 4 clusters: inside them
  picks(8, 64, true, 1, 1, false);      // forced 1: nothing to merge
  for (int tiles : {1, 2, 7, 20, 64, 1000, 100000})
    for (long long ctas : {1ll, 8ll, 100ll, 10000ll}) {
      const int splits = choose_kv_splits(ctas, h200, tiles, 32768, true, 0).count;
      CHECK(splits >= 1);
      CHECK(splits <= std::min(tiles, detail::kMaxKvSplits));
      const int share = (tiles + splits - 1) / splits;
      CHECK((splits - 1) * share < tiles);  // every split gets a tile
    }
}

TEST_CASE("kvcache: the specs dispatch picks are legal on every arch", "[spec]") {
  for (const char* arch_name : {"sm_80", "sm_86", "sm_89", "sm_90a"})
    for (int head_dim : {32, 64, 96, 128, 160, 192, 224, 256})
      for (MaskKind mask : {MaskKind::none, MaskKind::causal, MaskKind::window}) {
        const Arch arch = Arch::parse(arch_name);
        INFO(arch_name << " d" << head_dim);
        const auto specs = heuristic_kvcache_specs(arch, DType::bf16, head_dim, mask);
        REQUIRE(!specs.empty());
        for (const KernelSpec& s : specs) {
          INFO(s.name());
          CHECK(s.family == Family::kvcache_fwd);
          CHECK_FALSE(s.validate());
          const KernelLayout layout = kernel_layout(s);
          // sm_90 adds the warp that issues the bulk copies.
          CHECK(layout.threads == 32 * (s.num_warps + (arch.sm >= 90 ? 1 : 0)));
          CHECK(layout.entry_index("attention") < layout.entries.size());
        }
        CHECK(specs.front().block_m <= 32);  // the decode tile first
      }
  const auto hopper = heuristic_kvcache_specs(Arch::parse("sm_90a"), DType::bf16, 128, MaskKind::none);
  REQUIRE(hopper.size() == 3);
  CHECK(hopper[0].name() == "kvcache_fwd_bf16_d128_m16n64w4s3_sm90a");
  CHECK(hopper[1].block_m == 32);
  CHECK(hopper[2].block_m == 64);
}
