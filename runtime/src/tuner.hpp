// runtime/tuner internals that need no GPU, so the CPU tests can pin them down.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace flashjit::detail {

// The finalists' re-timed medians (ms, candidate index) ranked for the tuning entry: fastest first,
// except that the heuristic's candidate `heuristic` (one of them) goes first unless the fastest
// beats it by at least `margin` (a fraction of its time). The rest keep their order.
std::vector<std::pair<double, size_t>> rank_against_heuristic(std::vector<std::pair<double, size_t>> medians,
                                                              size_t heuristic, double margin);

}  // namespace flashjit::detail
