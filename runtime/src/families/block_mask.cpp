// block_mask at run time: the classify pass (unless a tile map is given) into a stream-ordered tile
// map, then the row lists and, where asked for, the column lists. Dispatch picks it for the
// block_mask pass only; its spec's tiles are the block sizes, so fit_to_problem sets them.
#include "../family.hpp"

namespace flashjit::detail {
namespace {

std::optional<std::string> unusable_reason(const PassProblem&, const Arch&) { return std::nullopt; }

std::vector<KernelSpec> tuning_candidates(const KernelSpec& base) { return {base}; }

void fit_to_problem(KernelSpec& spec, const PassProblem& problem) {
  spec.block_m = problem.block_mask->q_block_size;
  spec.block_n = problem.block_mask->kv_block_size;
}

void run(const FamilyCall& call) {
  const BlockMaskProblem& problem = call.block_mask();
  BlockMaskParams params = problem.params;
  const unsigned pairs = static_cast<unsigned>(problem.forward.batch) * problem.forward.heads_q;
  const int warps = call.spec.num_warps;
  const size_t map_bytes = size_t(pairs) * params.q_blocks * params.kv_blocks;
  StreamWorkspace workspace(problem.forward.device, call.stream, problem.has_tile_map ? 0 : map_bytes);
  if (!problem.has_tile_map) {
    params.tile_map = reinterpret_cast<unsigned char*>(workspace.get());
    call.launch("classify", Grid{blocks(params.kv_blocks, warps), static_cast<unsigned>(params.q_blocks), pairs}, params);
  }
  call.launch("rows", Grid{blocks(params.q_blocks, warps), pairs}, params);
  if (params.q_num_blocks != nullptr) call.launch("columns", Grid{blocks(params.kv_blocks, warps), pairs}, params);
}

}  // namespace

extern const RuntimeFamily kBlockMaskFamily;
const RuntimeFamily kBlockMaskFamily{Family::block_mask, Pass::block_mask, Backend::automatic, /*automatic=*/true,
                                     Family::block_mask, unusable_reason, tuning_candidates, run, fit_to_problem};

}  // namespace flashjit::detail
