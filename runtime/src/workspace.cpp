#include "workspace.hpp"

#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace flashjit::detail {
namespace {

CUmemoryPool device_pool(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, CUmemoryPool> pools;
  std::lock_guard<std::mutex> lock(mutex);
  CUmemoryPool& pool = pools[device];
  if (pool == nullptr) {
    CUmemPoolProps props{};
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = device;
    CUmemoryPool created = nullptr;
    FLASHJIT_CU(cuMemPoolCreate, &created, &props);
    cuuint64_t keep_everything = UINT64_MAX;
    FLASHJIT_CU(cuMemPoolSetAttribute, created, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep_everything);
    pool = created;
  }
  return pool;
}

}  // namespace

StreamWorkspace::StreamWorkspace(int device, CUstream stream, size_t bytes) : stream_(stream) {
  if (bytes > 0) FLASHJIT_CU(cuMemAllocFromPoolAsync, &pointer_, bytes, device_pool(device), stream_);
}

StreamWorkspace::~StreamWorkspace() {
  // Launch failures unwind through here: the free is still ordered after whatever was enqueued.
  if (pointer_ != 0 && driver_available()) driver().cuMemFreeAsync(pointer_, stream_);
}

}  // namespace flashjit::detail
