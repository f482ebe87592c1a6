#include "wgmma.hpp"

#include <fmt/format.h>

#include "flashjit/error.hpp"

namespace flashjit::codegen_detail {

std::string wgmma_member_function(std::string_view name, int n, DType dtype, WgmmaOperands operands) {
  const bool fp8 = dtype == DType::e4m3;
  const int k = fp8 ? 32 : 16;
  if (n < 8 || n > 256 || n % 8 != 0)
    throw Error(ErrorCode::internal, "codegen", fmt::format("wgmma has no m64n{}k{} shape", n, k));
  const bool a_in_registers = operands == WgmmaOperands::rs_b_mn_major || operands == WgmmaOperands::rs_k_major;
  if (fp8 && operands != WgmmaOperands::ss_k_major && operands != WgmmaOperands::rs_k_major)
    throw Error(ErrorCode::internal, "codegen", "8-bit wgmma reads its shared-memory operands K-major only");
  const int accumulators = n / 2;
  const std::string_view type = dtype == DType::fp16 ? "f16" : dtype == DType::bf16 ? "bf16" : "e4m3";

  std::string d_list, d_operands;
  for (int i = 0; i < accumulators; ++i) {
    fmt::format_to(std::back_inserter(d_list), "{}%{}", i ? ", " : "", i);
    fmt::format_to(std::back_inserter(d_operands), "{}\"+f\"(d[{}])", i ? ", " : "", i);
  }
  int next = accumulators;
  std::string a_text, inputs;
  if (a_in_registers) {
    a_text = fmt::format("{{%{}, %{}, %{}, %{}}}", next, next + 1, next + 2, next + 3);
    inputs = "\"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), ";
    next += 4;
  } else {
    a_text = fmt::format("%{}", next++);
    inputs = "\"l\"(desc_a), ";
  }
  const int b_index = next++, accumulate_index = next;
  inputs += "\"l\"(desc_b), \"r\"(accumulate ? 1 : 0)";
  // Immediates: scale-a, scale-b = 1; for 16-bit types, SS adds transpose-a and transpose-b (0:
  // K-major, 1: MN-major) and RS transpose-b = 1 (MN-major B); 8-bit types have no transposes.
  const std::string_view immediates = fp8                                        ? "1, 1"
                                      : a_in_registers                           ? "1, 1, 1"
                                      : operands == WgmmaOperands::ss_mn_major   ? "1, 1, 1, 1"
                                      : operands == WgmmaOperands::ss_b_mn_major ? "1, 1, 0, 1"
                                      : operands == WgmmaOperands::ss_a_mn_major ? "1, 1, 1, 0"
                                                                                 : "1, 1, 0, 0";
  const std::string a_parameter =
      a_in_registers ? "const unsigned (&a)[4]" : "unsigned long long desc_a";

  return fmt::format(
      "  static __device__ __forceinline__ void {name}(float (&d)[{acc}], {a_param},\n"
      "      unsigned long long desc_b, bool accumulate) {{\n"
      "    asm volatile(\n"
      "        \"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc_idx}, 0;\\n\"\n"
      "        \"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{type}.{type} {{{d_list}}}, {a_text}, %{b_idx}, p, "
      "{imm};\\n}}\\n\"\n"
      "        : {d_ops}\n"
      "        : {inputs});\n"
      "  }}\n",
      fmt::arg("name", name), fmt::arg("acc", accumulators), fmt::arg("a_param", a_parameter),
      fmt::arg("acc_idx", accumulate_index), fmt::arg("n", n), fmt::arg("k", k), fmt::arg("type", type),
      fmt::arg("d_list", d_list), fmt::arg("a_text", a_text), fmt::arg("b_idx", b_index),
      fmt::arg("imm", immediates), fmt::arg("d_ops", d_operands), fmt::arg("inputs", inputs));
}

}  // namespace flashjit::codegen_detail
