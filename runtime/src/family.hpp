// runtime/families: what each kernel family does at run time, behind one interface. A family's
// module (runtime/src/families/<family>.cpp, beside codegen/src/families/<family>.cpp) says which
// problems it can run, builds its kernel parameters, grids and workspace, launches its entry points
// by name, and lists its tuning candidates. Dispatch and the runtime walk the family table
// (family.cpp) and never name a family.
#pragma once

#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "driver.hpp"
#include "flashjit/device.hpp"
#include "module_cache.hpp"
#include "problem.hpp"
#include "workspace.hpp"

namespace flashjit::detail {

enum class Pass { forward, backward, kvcache, block_mask };

// A problem as the families see it: the forward's part in both passes, and in the backward pass the
// backward's, where it is known (the tuner and the tools plan a backward from its forward part:
// then atomic dQ, and dout laid out like out).
struct PassProblem {
  Pass pass;
  const ForwardProblem& forward;
  const BackwardProblem* backward = nullptr;
  const KvCacheProblem* kvcache = nullptr;  // the kvcache pass's
  const BlockMaskProblem* block_mask = nullptr;  // the block_mask pass's

  bool deterministic() const { return backward != nullptr && backward->deterministic; }
  const char* operation() const {
    return pass == Pass::forward    ? "forward"
           : pass == Pass::backward ? "backward"
           : pass == Pass::kvcache  ? "forward_kvcache"
                                    : "create_block_mask";
  }
  bool is_empty() const {
    switch (pass) {
      case Pass::forward: return forward.is_empty();
      case Pass::backward: return backward->is_empty();
      case Pass::kvcache: return kvcache->is_empty();
      case Pass::block_mask: return block_mask->is_empty();
    }
    return false;
  }
};

// CTAs in x, y, z; cluster_x > 1 launches them in thread-block clusters of that many along x, one
// CTA per SM (sm_90; x a multiple of it, and a size LoadedKernel::clusters_at_once counts).
struct Grid {
  unsigned x, y = 1, z = 1;
  unsigned cluster_x = 1;
};

// How a launch follows the stream's previous kernel: after it completes, or (sm_90's programmatic
// dependent launch) as soon as every CTA of it has signalled griddepcontrol.launch_dependents, so
// the launch overlaps its tail; the entry must then execute griddepcontrol.wait before it reads
// what the previous kernel wrote.
enum class StreamOrder { after_completion, overlapping_tail };
inline unsigned blocks(long long extent, int tile) { return static_cast<unsigned>((extent + tile - 1) / tile); }

// One call of a family: its problem, the dispatched spec, the loaded kernel and where it runs.
struct FamilyCall {
  const PassProblem& problem;
  const KernelSpec& spec;
  const LoadedKernel& kernel;
  const DeviceProperties& device;
  CUstream stream;

  const ForwardProblem& forward() const { return problem.forward; }
  const BackwardProblem& backward() const { return *problem.backward; }
  const KvCacheProblem& kvcache() const { return *problem.kvcache; }
  const BlockMaskProblem& block_mask() const { return *problem.block_mask; }
  const KernelLayout& layout() const { return kernel.layout; }

  // Launches entry `entry` (its codegen name) on the call's stream, with the threads and dynamic
  // shared memory codegen computed for it.
  template <class Params>
  void launch(std::string_view entry, Grid grid, const Params& params,
              StreamOrder order = StreamOrder::after_completion) const {
    Params copy = params;
    launch_entry(entry, grid, &copy, order);
  }

 private:
  void launch_entry(std::string_view entry, Grid grid, void* params, StreamOrder order) const;
};

struct RuntimeFamily {
  Family family;
  Pass pass;
  // The AttentionOptions::backend that asks for this family by name, and whether the automatic
  // backend considers it (the table's order is the automatic backend's preference).
  Backend backend;
  bool automatic;
  // The family whose tuning entries and kernel head dims a problem is keyed by: the family itself,
  // or one it shares them with, so that one tuning entry can hold either's spec and the tuner times
  // both (sm90_bwd shares fa2_bwd's). A family is chosen only for problems whose kernel head dim in
  // that family is one of its own: no compute is wasted on more padding than the key family's.
  Family tuning_key;
  // Why the family cannot run this problem on this arch (the arch, the memory layout, a mode it
  // lacks), or nothing when it can.
  std::optional<std::string> (*unusable_reason)(const PassProblem& problem, const Arch& arch);
  // The specs the tuner times, from `base` (the default spec of the problem's dtype, kernel head
  // dim, mask and softcap): the legal ones of the family's tile grid.
  std::vector<KernelSpec> (*tuning_candidates)(const KernelSpec& base);
  // Builds the parameters, grids and workspace and launches the family's entry sequence.
  void (*run)(const FamilyCall& call);
  // Fits the default spec's tiles to the problem where the best tile depends on it (the packed
  // query rows of a decode step); null: the default spec serves every problem.
  void (*fit_to_problem)(KernelSpec& spec, const PassProblem& problem) = nullptr;
};

// Helpers that several families share.

// Why a family of sm_90a code (wgmma, setmaxnreg) cannot run on `arch`, or nothing on sm_90a.
std::optional<std::string> hopper_arch_reason(Family family, const Arch& arch);

// One CTA per block_m query rows of each (head, batch): the grid of the non-persistent forwards.
Grid query_block_grid(const ForwardProblem& problem, int block_m);

// One side of a block mask fitted to a kernel's tiles: a row tile of `row_tile` lies in one row
// block and a column block is whole column tiles (sets tiles_per_block), or Error(invalid_argument)
// naming the kernel. The forwards' rows are query blocks (row tile block_m, column tile block_n);
// the backward's are key blocks (block_n, then block_m).
void fit_block_mask_to_tiles(BlockSparseParams& mask, const KernelSpec& spec, bool rows_are_queries, int row_tile,
                             int column_tile, const char* pass);

// The legal specs of a tile grid: `base` with every (block_m, block_n, warps, stages) of the lists
// that validate() accepts, in that nesting order.
std::vector<KernelSpec> tile_grid_candidates(const KernelSpec& base, std::initializer_list<int> block_ms,
                                             std::initializer_list<int> block_ns, std::initializer_list<int> warps,
                                             std::initializer_list<int> stages);

// The mma.sync families' tile grid (block_m 32-256, block_n 32-128, 4 or 8 warps, 1-3 stages),
// what validate() accepts of it.
std::vector<KernelSpec> mma_sync_tile_candidates(const KernelSpec& base);

// How a backward family sums dQ over the key tiles: `atomic`, in any order, into the fp32
// accumulator; `ordered`, the same in key-tile order (sm90_bwd's deterministic mode: an order counter
// per query block beside the accumulator, AttentionBwdParams::dq_order, and under a block mask the
// key tiles visiting each block, dq_visits); `separate`, in a later query-outer entry of its own
// (fa2_bwd's deterministic mode: no accumulator).
enum class DqAccumulation { atomic, ordered, separate };

// What every backward family's entry sequence shares: the scratch memory (delta and, unless dQ is
// separate, the fp32 dQ accumulator after it, then any order counters and visit bits, zeroed on
// the stream), stream-ordered, and the grids of the row passes (preprocess, convert_dq) and of the key tiles. No
// queries still means dK = dV = 0 to write; no keys, dQ = 0: `has_queries` and `has_keys` say which
// entries have work.
struct BackwardLaunch {
  BackwardLaunch(const FamilyCall& call, DqAccumulation dq);
  StreamWorkspace workspace;
  AttentionBwdParams params;  // the problem's, with the workspace pointers set
  Grid query_rows, key_tiles;
  bool has_queries, has_keys;
};

// The table, in the automatic backend's order of preference within each pass.
const std::vector<const RuntimeFamily*>& runtime_families();
const RuntimeFamily& runtime_family(Family family);

}  // namespace flashjit::detail
