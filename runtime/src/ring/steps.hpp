// Pieces both of ring attention's passes use on one rank (forward.cpp, backward.cpp): the
// communication stream and events of a call, the check that every rank calls alike, row views of
// shards, and the copy of k and v into a travel buffer.
#pragma once

#include <memory>
#include <string>

#include "../driver.hpp"
#include "flashjit/ring.hpp"

namespace flashjit::ring::detail {

// A communication stream and the events of one call, lent from a per-process pool (creating a
// stream per call cost more than a short step). A set returns once its call has queued its work: the
// next call to take it queues behind what is left on the stream and records the events anew.
struct ExchangeSet {
  int device = 0;
  CUstream comm = nullptr;
  CUevent inputs_ready = nullptr, comm_done = nullptr;
  CUevent received[2] = {}, computed[2] = {}, gradients_received[2] = {};
};
class ExchangeSetLease {
 public:
  explicit ExchangeSetLease(int device);
  ~ExchangeSetLease();
  ExchangeSetLease(const ExchangeSetLease&) = delete;
  ExchangeSetLease& operator=(const ExchangeSetLease&) = delete;
  ExchangeSet* operator->() const { return set_.get(); }

 private:
  std::unique_ptr<ExchangeSet> set_;
};

// The shards' shapes and dtype (4-D, k's rows q's, 16-bit, zigzag's two chunks); then the driver
// and q's device's context, and with options.check_shapes one all-gather of a header and a wait:
// every rank throws, naming the field and ranks, unless all called with the same shapes and options. `pass`: "ring forward" or
// "ring backward", in the errors.
void check_shards(Transport& transport, const TensorView& q, const TensorView& k, const TensorView& v,
                  const TensorView& out, bool has_lse, const Options& options, const char* pass);

// Rows [begin, begin + rows) of a (batch, rows, heads, head_dim) view.
TensorView rows_of(const TensorView& t, int64_t begin, int64_t rows);
// Rows [begin, begin + rows) of a (batch, heads, rows) view (an LSE).
TensorView lse_rows(const TensorView& lse, int64_t begin, int64_t rows);
// Copies k (or v) into its part of a travel buffer, (batch, rows, heads_kv, head_dim) contiguous.
void pack(const TensorView& t, char* destination, CUstream stream);

}  // namespace flashjit::ring::detail
