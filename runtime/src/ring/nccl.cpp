// The NCCL transport. libnccl.so.2 is dlopened on first use, as libcuda is (driver.cpp), so the
// library builds without NCCL's headers and runs where NCCL is absent. The few declarations it needs
// are NCCL's stable C ABI (nccl.h, NCCL 2.x): opaque communicators, int result codes, and the
// unique id as 128 bytes passed by value.
#include <dlfcn.h>

#include <cstring>
#include <mutex>

#include <fmt/format.h>

#include "../driver.hpp"
#include "../env.hpp"
#include "flashjit/ring.hpp"

namespace flashjit::ring {

namespace {

using NcclComm = void*;
using NcclResult = int;  // ncclResult_t: 0 is ncclSuccess
constexpr int kNcclUint8 = 1;  // ncclDataType_t ncclUint8
struct NcclUniqueId {
  char internal[128];
};

struct NcclApi {
  NcclResult (*ncclGetVersion)(int*) = nullptr;
  const char* (*ncclGetErrorString)(NcclResult) = nullptr;
  NcclResult (*ncclGetUniqueId)(NcclUniqueId*) = nullptr;
  NcclResult (*ncclCommInitRank)(NcclComm*, int, NcclUniqueId, int) = nullptr;
  NcclResult (*ncclCommDestroy)(NcclComm) = nullptr;
  NcclResult (*ncclCommCount)(NcclComm, int*) = nullptr;
  NcclResult (*ncclCommUserRank)(NcclComm, int*) = nullptr;
  NcclResult (*ncclGroupStart)() = nullptr;
  NcclResult (*ncclGroupEnd)() = nullptr;
  NcclResult (*ncclSend)(const void*, size_t, int, int, NcclComm, CUstream) = nullptr;
  NcclResult (*ncclRecv)(void*, size_t, int, int, NcclComm, CUstream) = nullptr;
  NcclResult (*ncclAllGather)(const void*, void*, size_t, int, NcclComm, CUstream) = nullptr;
  int version = 0;
};

struct Loaded {
  NcclApi api;
  std::string failure;  // empty: loaded
};

Loaded load_nccl() {
  Loaded result;
  const auto& configured = detail::environment().nccl_library;
  const std::string path = configured.value_or("libnccl.so.2");
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    result.failure = fmt::format("NCCL could not be loaded from {} ({}): install NCCL (PyTorch's wheel brings it, "
                                 "nvidia/nccl/lib) and put it on the library path or set FLASHJIT_NCCL_LIBRARY",
                                 path, why != nullptr ? why : "not found");
    return result;
  }
  NcclApi& api = result.api;
  bool complete = true;
  auto bind = [&](auto& pointer, const char* name) {
    pointer = reinterpret_cast<std::remove_reference_t<decltype(pointer)>>(dlsym(handle, name));
    if (pointer == nullptr && complete) {
      result.failure = fmt::format("{} has no {}: flashjit needs NCCL 2.7 or newer (point-to-point sends)", path, name);
      complete = false;
    }
  };
  bind(api.ncclGetVersion, "ncclGetVersion");
  bind(api.ncclGetErrorString, "ncclGetErrorString");
  bind(api.ncclGetUniqueId, "ncclGetUniqueId");
  bind(api.ncclCommInitRank, "ncclCommInitRank");
  bind(api.ncclCommDestroy, "ncclCommDestroy");
  bind(api.ncclCommCount, "ncclCommCount");
  bind(api.ncclCommUserRank, "ncclCommUserRank");
  bind(api.ncclGroupStart, "ncclGroupStart");
  bind(api.ncclGroupEnd, "ncclGroupEnd");
  bind(api.ncclSend, "ncclSend");
  bind(api.ncclRecv, "ncclRecv");
  bind(api.ncclAllGather, "ncclAllGather");
  if (complete) api.ncclGetVersion(&api.version);
  return result;
}

const Loaded& loaded() {
  static const Loaded result = load_nccl();
  return result;
}

const NcclApi& nccl() {
  const Loaded& l = loaded();
  if (!l.failure.empty()) throw Error(ErrorCode::no_driver, "nccl", l.failure);
  return l.api;
}

void check_nccl(NcclResult result, const char* call) {
  if (result == 0) return;
  const char* text = nccl().ncclGetErrorString(result);
  throw Error(ErrorCode::cuda_error, call, fmt::format("NCCL error {}: {}", result, text != nullptr ? text : "?"));
}

}  // namespace

std::optional<int> nccl_version(std::string* why_not) {
  const Loaded& l = loaded();
  if (l.failure.empty()) return l.api.version;
  if (why_not != nullptr) *why_not = l.failure;
  return std::nullopt;
}

std::vector<char> nccl_unique_id() {
  NcclUniqueId id;
  check_nccl(nccl().ncclGetUniqueId(&id), "ncclGetUniqueId");
  return std::vector<char>(id.internal, id.internal + sizeof(id.internal));
}

NcclTransport::NcclTransport(void* nccl_comm) : comm_(nccl_comm) {
  if (nccl_comm == nullptr) throw Error(ErrorCode::invalid_argument, "ring", "the NCCL communicator is null");
  check_nccl(nccl().ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
  check_nccl(nccl().ncclCommCount(comm_, &world_), "ncclCommCount");
}

NcclTransport::NcclTransport(const std::vector<char>& unique_id, int rank, int world) : owns_comm_(true), rank_(rank), world_(world) {
  NcclUniqueId id;
  if (unique_id.size() != sizeof(id.internal))
    throw Error(ErrorCode::invalid_argument, "ring",
                fmt::format("an NCCL unique id has {} bytes, got {}", sizeof(id.internal), unique_id.size()));
  if (world < 1 || rank < 0 || rank >= world)
    throw Error(ErrorCode::invalid_argument, "ring", fmt::format("rank {} of {} ranks", rank, world));
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  check_nccl(nccl().ncclCommInitRank(&comm_, world, id, rank), "ncclCommInitRank");
}

NcclTransport::~NcclTransport() {
  if (owns_comm_ && comm_ != nullptr) nccl().ncclCommDestroy(comm_);
}

void NcclTransport::shift(const void* send, void* recv, size_t bytes, void* stream) {
  const NcclApi& api = nccl();
  const auto s = static_cast<CUstream>(stream);
  // Both directions in one group: each rank's send pairs with the next one's receive.
  check_nccl(api.ncclGroupStart(), "ncclGroupStart");
  NcclResult send_result = api.ncclSend(send, bytes, kNcclUint8, (rank_ + 1) % world_, comm_, s);
  NcclResult recv_result = api.ncclRecv(recv, bytes, kNcclUint8, (rank_ + world_ - 1) % world_, comm_, s);
  const NcclResult end_result = api.ncclGroupEnd();
  check_nccl(send_result, "ncclSend");
  check_nccl(recv_result, "ncclRecv");
  check_nccl(end_result, "ncclGroupEnd");
}

void NcclTransport::all_gather(const void* send, void* recv, size_t bytes, void* stream) {
  check_nccl(nccl().ncclAllGather(send, recv, bytes, kNcclUint8, comm_, static_cast<CUstream>(stream)), "ncclAllGather");
}

}  // namespace flashjit::ring
