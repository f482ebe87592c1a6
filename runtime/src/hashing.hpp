// Content hashes for cache keys and cubin checksums: XXH3-128, as 32 lowercase hex digits.
#pragma once

#include <string>
#include <string_view>

namespace flashjit::detail {

class Hasher {
 public:
  Hasher();
  ~Hasher();
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;

  // Each part is length-prefixed, so ("ab", "c") and ("a", "bc") hash differently.
  Hasher& add(std::string_view part);
  std::string hex() const;

 private:
  void* state_;
};

std::string hash_hex(std::string_view bytes);

}  // namespace flashjit::detail
