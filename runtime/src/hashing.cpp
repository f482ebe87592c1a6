#include "hashing.hpp"

#include <cstdint>

#include <fmt/format.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace flashjit::detail {

Hasher::Hasher() : state_(XXH3_createState()) { XXH3_128bits_reset(static_cast<XXH3_state_t*>(state_)); }

Hasher::~Hasher() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }

Hasher& Hasher::add(std::string_view part) {
  auto* state = static_cast<XXH3_state_t*>(state_);
  const uint64_t length = part.size();
  XXH3_128bits_update(state, &length, sizeof length);
  XXH3_128bits_update(state, part.data(), part.size());
  return *this;
}

std::string Hasher::hex() const {
  XXH128_hash_t h = XXH3_128bits_digest(static_cast<XXH3_state_t*>(state_));
  return fmt::format("{:016x}{:016x}", h.high64, h.low64);
}

std::string hash_hex(std::string_view bytes) {
  XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  return fmt::format("{:016x}{:016x}", h.high64, h.low64);
}

}  // namespace flashjit::detail
