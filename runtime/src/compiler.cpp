#include "compiler.hpp"
#include "files.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <nvrtc.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include <fmt/format.h>

#include "env.hpp"
#include "flashjit/error.hpp"

namespace flashjit {

std::string nvrtc_version() {
  int major = 0, minor = 0;
  nvrtcVersion(&major, &minor);
  return fmt::format("{}.{}", major, minor);
}

bool nvrtc_supports(const Arch& arch) {
  int count = 0;
  if (nvrtcGetNumSupportedArchs(&count) != NVRTC_SUCCESS) return false;
  std::vector<int> archs(count);
  if (nvrtcGetSupportedArchs(archs.data()) != NVRTC_SUCCESS) return false;
  return std::find(archs.begin(), archs.end(), arch.sm) != archs.end();
}

namespace detail {
namespace {

// RAII over nvrtcProgram; every NVRTC status is checked.
class Program {
 public:
  Program(const Source& source) {
    const auto& bundle = template_bundle();
    std::vector<const char*> header_texts, header_names;
    for (const auto& file : bundle.files) {
      // TemplateFile views point into static storage generated at build time: NUL-terminated.
      header_texts.push_back(file.text.data());
      header_names.push_back(file.path.data());
    }
    check(nvrtcCreateProgram(&program_, source.text.c_str(), source.file_name.c_str(),
                             static_cast<int>(header_texts.size()), header_texts.data(),
                             header_names.data()),
          "nvrtcCreateProgram");
  }
  ~Program() { nvrtcDestroyProgram(&program_); }
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;

  nvrtcProgram get() const { return program_; }

  std::string log() const {
    size_t size = 0;
    check(nvrtcGetProgramLogSize(program_, &size), "nvrtcGetProgramLogSize");
    std::string text(size, '\0');
    check(nvrtcGetProgramLog(program_, text.data()), "nvrtcGetProgramLog");
    while (!text.empty() && text.back() == '\0') text.pop_back();
    return text;
  }

  static void check(nvrtcResult result, const char* call) {
    if (result != NVRTC_SUCCESS)
      throw Error(ErrorCode::compile_failed, call, nvrtcGetErrorString(result));
  }

 private:
  nvrtcProgram program_ = nullptr;
};

int to_int(const std::string& text) { return std::stoi(text); }

// One dump file, 0600, replacing what is there: an existing name is unlinked first (a symlink
// planted there is removed, its target untouched) and the file created with O_EXCL | O_NOFOLLOW.
void write_dump_file(const std::string& path, std::string_view text) {
  ::unlink(path.c_str());
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0)
    throw Error(ErrorCode::io_error, "FLASHJIT_DUMP_DIR", fmt::format("cannot create {}: {}", path, std::strerror(errno)));
  const bool written = write_all(fd, text);
  ::close(fd);
  if (!written)
    throw Error(ErrorCode::io_error, "FLASHJIT_DUMP_DIR", fmt::format("cannot write {}", path));
}

void dump(const Source& source, const Arch& arch, const std::string& log, const Program& program) {
  const auto& dir = environment().dump_dir;
  if (!dir) return;
  struct stat st {};
  if (::stat(dir->c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    throw Error(ErrorCode::invalid_argument, "FLASHJIT_DUMP_DIR",
                fmt::format("{} is not a directory (create it, or unset FLASHJIT_DUMP_DIR)", *dir));
  const std::string base = fmt::format("{}/{}", *dir, source.spec_name);
  write_dump_file(base + ".cu", source.text);
  write_dump_file(base + ".log", log);
  size_t ptx_size = 0;
  if (nvrtcGetPTXSize(program.get(), &ptx_size) == NVRTC_SUCCESS && ptx_size > 1) {
    std::string ptx(ptx_size, '\0');
    if (nvrtcGetPTX(program.get(), ptx.data()) == NVRTC_SUCCESS) write_dump_file(base + "." + arch.name() + ".ptx", ptx.c_str());
  }
}

}  // namespace

std::vector<std::string> compile_options(const Arch& arch) {
  return {
      "--gpu-architecture=" + arch.name(),
      "-std=c++17",
      "-default-device",
      "-lineinfo",                  // source lines for ncu and compute-sanitizer; no runtime cost
      "--ptxas-options=--verbose",  // registers, smem and spills for CompiledKernel::entries
  };
}

CompileOutput compile_source(const Source& source, const Arch& arch) {
  const auto start = std::chrono::steady_clock::now();
  Program program(source);
  const std::vector<std::string> options = compile_options(arch);
  std::vector<const char*> option_pointers;
  for (const auto& option : options) option_pointers.push_back(option.c_str());
  const nvrtcResult result = nvrtcCompileProgram(
      program.get(), static_cast<int>(option_pointers.size()), option_pointers.data());

  CompileOutput out;
  out.log = program.log();
  dump(source, arch, out.log, program);
  if (result != NVRTC_SUCCESS)
    throw Error(ErrorCode::compile_failed, "compile", describe_compile_failure(source, arch, out.log));
  size_t size = 0;
  Program::check(nvrtcGetCUBINSize(program.get(), &size), "nvrtcGetCUBINSize");
  out.cubin.resize(size);
  Program::check(nvrtcGetCUBIN(program.get(), out.cubin.data()), "nvrtcGetCUBIN");
  out.entries = parse_ptxas_stats(out.log);
  out.compile_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (environment().verbose)
    fmt::print(stderr, "flashjit: compiled {} for {} in {:.0f} ms\n{}", source.spec_name,
               arch.name(), out.compile_ms, out.log);
  return out;
}

namespace {

// The patterns the logs are read with, built once.
struct LogPatterns {
  const std::regex entry{R"(Compiling entry function '([^']+)')"};
  const std::regex properties{R"(Function properties for (\S+))"};
  const std::regex frame{R"((\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads)"};
  const std::regex used{R"(Used (\d+) registers)"};
  const std::regex barriers{R"(used (\d+) barriers)"};
  const std::regex smem{R"((\d+) bytes smem)"};
  const std::regex diagnostic{R"(^(.+)\((\d+)\): (error|catastrophic error))"};
};

const LogPatterns& log_patterns() {
  static const LogPatterns patterns;
  return patterns;
}

}  // namespace

void construct_compiler_statics() {
  template_bundle();
  environment();
  log_patterns();
}

std::vector<EntryStats> parse_ptxas_stats(std::string_view log) {
  const LogPatterns& re = log_patterns();
  std::vector<EntryStats> entries;
  std::map<std::string, size_t> index;
  EntryStats* current = nullptr;     // the entry whose "Used ..." line comes next
  EntryStats* properties = nullptr;  // the entry whose stack/spill line comes next
  std::istringstream lines{std::string(log)};
  std::string line;
  std::smatch m;
  while (std::getline(lines, line)) {
    if (std::regex_search(line, m, re.entry)) {
      index[m[1]] = entries.size();
      entries.push_back(EntryStats{m[1]});
      current = &entries.back();
      properties = nullptr;
    } else if (std::regex_search(line, m, re.properties)) {
      auto it = index.find(m[1]);
      properties = it == index.end() ? nullptr : &entries[it->second];  // skip device functions
    } else if (std::regex_search(line, m, re.frame)) {
      if (properties) {
        properties->stack_frame_bytes = to_int(m[1]);
        properties->spill_store_bytes = to_int(m[2]);
        properties->spill_load_bytes = to_int(m[3]);
      }
    } else if (std::regex_search(line, m, re.used)) {
      if (current) {
        current->registers = to_int(m[1]);
        if (std::regex_search(line, m, re.barriers)) current->barriers = to_int(m[1]);
        if (std::regex_search(line, m, re.smem)) current->static_smem_bytes = to_int(m[1]);
      }
    }
  }
  return entries;
}

std::string describe_compile_failure(const Source& source, const Arch& arch, std::string_view log) {
  auto file_text = [&](const std::string& name) -> std::string_view {
    if (name == source.file_name) return source.text;
    for (const auto& [user_file, text] : source.user_files)
      if (user_file == name) return text;
    for (const auto& file : template_bundle().files)
      if (file.path == name) return file.text;
    return {};
  };
  std::string message = fmt::format("NVRTC could not compile kernel {} for {}:\n{}",
                                    source.spec_name, arch.name(), log);
  std::istringstream lines{std::string(log)};
  std::string line;
  std::smatch m;
  int shown = 0;
  while (std::getline(lines, line) && shown < 5) {
    if (!std::regex_search(line, m, log_patterns().diagnostic)) continue;
    ++shown;
    const std::string file = m[1];
    const int error_line = std::stoi(m[2]);
    std::string_view text = file_text(file);
    if (text.empty()) continue;
    message += fmt::format("\n--- {} around line {}:\n", file, error_line);
    int number = 1;
    size_t pos = 0;
    while (pos <= text.size()) {
      size_t end = text.find('\n', pos);
      if (end == std::string_view::npos) end = text.size();
      if (number >= error_line - 3 && number <= error_line + 3)
        message += fmt::format("{} {:5} | {}\n", number == error_line ? ">" : " ", number,
                               text.substr(pos, end - pos));
      if (number > error_line + 3) break;
      pos = end + 1;
      ++number;
    }
  }
  // A backward's score body runs on dual numbers when the modifier has no gradient body: say so.
  if (source.text.find("flashjit::kernels::ScoreDual(") != std::string::npos &&
      log.find(fmt::format("{}(", kScoreModFile)) != std::string_view::npos)
    message += fmt::format(
        "\nnote: the backward derives the score body's gradient by running it on dual numbers: values computed "
        "from `score` must be `auto` (not `float`), built from + - * /, comparisons and the math functions "
        "templates/common/modifiers.cuh lists; or give the gradient body ({})",
        kScoreGradFile);
  return message;
}

}  // namespace detail
}  // namespace flashjit
