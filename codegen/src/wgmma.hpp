// wgmma instruction wrappers, generated for the exact shapes a spec uses. A wgmma's accumulators
// are N / 2 separate asm operands, so each N needs its own asm statement; rendering them here keeps
// the templates free of hand-expanded operand lists for every tile width.
#pragma once

#include <string>
#include <string_view>

#include "flashjit/codegen/kernel_spec.hpp"

namespace flashjit::codegen_detail {

enum class WgmmaOperands {
  ss_k_major,            // A and B from shared-memory descriptors, both K-major
  rs_b_mn_major,         // A from registers (four 16-bit pairs per thread), B MN-major in shared memory
  ss_mn_major,           // A and B from shared-memory descriptors, both MN-major (transposed)
  ss_b_mn_major,         // A and B from shared-memory descriptors, A K-major, B MN-major
  ss_a_mn_major,         // A and B from shared-memory descriptors, A MN-major, B K-major
  rs_k_major,            // A from registers, B K-major in shared memory (8-bit types have no other B)
};

// A static __device__ member function `name` computing D (64 x n, fp32) (+)= A B over one k step
// (k16 for 16-bit types, k32 for e4m3, whose operands must both be K-major):
//   ss_k_major, ss_mn_major, ss_b_mn_major, ss_a_mn_major:
//                  name(float (&d)[n / 2], unsigned long long desc_a, unsigned long long desc_b, bool accumulate)
//   rs_b_mn_major, rs_k_major:
//                  name(float (&d)[n / 2], const unsigned (&a)[4], unsigned long long desc_b, bool accumulate)
std::string wgmma_member_function(std::string_view name, int n, DType dtype, WgmmaOperands operands);

}  // namespace flashjit::codegen_detail
