// Ring attention on one GPU: N = 2, 4 and 8 virtual ranks (LocalRing) over contiguous and zigzag
// shards, causal and not, GQA, sequence- and head-major memory. The ranks' outputs and LSEs,
// unsharded, must match the float64 reference as a single flashjit call on the whole sequence does,
// with an RMS error at most 1.2x that call's. Beside them each case prints the error of the same
// steps run as plain calls whose 16-bit outputs are merged in fp32 (what ring libraries built on
// stock kernels compute).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>

#include "flashjit/ring.hpp"
#include "module_cache.hpp"

#include "support/attention_case.hpp"
#include "support/attention_checks.hpp"
#include "support/backward_case.hpp"

using namespace flashjit;
using namespace flashjit::test;

namespace {

struct RingRun {
  int world = 2;
  ring::Layout layout = ring::Layout::zigzag;
  bool causal = true;
  int window_left = -1, window_right = -1;
  int batch = 2, seqlen = 0, heads_q = 4, heads_kv = 2, head_dim = 128;
  DType dtype = DType::bf16;
  bool head_major = false;
  std::vector<int> seqlens;  // a packed batch of these whole lengths (varlen), sequence-major
  bool varlen() const { return !seqlens.empty(); }
};

// A varlen run's rank shard: for each of its packed rows, the row of the whole packed batch.
std::vector<int64_t> varlen_rows(const RingRun& r, int rank) {
  std::vector<int64_t> rows;
  int64_t whole_start = 0;
  for (int length : r.seqlens) {
    const ring::Shard shard = ring::shard_of(r.layout, rank, r.world, length);
    for (int64_t i = 0; i < shard.rows(); ++i) rows.push_back(whole_start + shard.global_row(i));
    whole_start += length;
  }
  return rows;
}

// Rows per rank shard (varlen: all its packed rows) and the batch dim of a shard (varlen: none, 1).
int shard_rows_of(const RingRun& r) {
  return static_cast<int>(r.varlen() ? varlen_rows(r, 0).size() : ring::shard_of(r.layout, 0, r.world, r.seqlen).rows());
}
int shard_batch(const RingRun& r) { return r.varlen() ? 1 : r.batch; }

// RMS of (got - want) over the elements the reference computed (large shapes: every few rows).
double rms_error(DType dtype, const std::vector<uint16_t>& got, const std::vector<double>& want) {
  double sum = 0;
  size_t count = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) continue;
    const double e = from_storage(dtype, got[i]) - want[i];
    sum += e * e;
    ++count;
  }
  return std::sqrt(sum / std::max<size_t>(count, 1));
}

// Rank shards of one packed (batch, seqlen, heads, head_dim) tensor, in the run's memory layout.
std::vector<uint16_t> shard_bits(const RingRun& r, const std::vector<uint16_t>& whole, int heads, int rank) {
  if (r.varlen()) {
    const std::vector<int64_t> rows = varlen_rows(r, rank);
    const size_t row_elements = size_t(heads) * r.head_dim;
    std::vector<uint16_t> out(rows.size() * row_elements);
    for (size_t i = 0; i < rows.size(); ++i)
      std::copy(&whole[rows[i] * row_elements], &whole[rows[i] * row_elements] + row_elements, &out[i * row_elements]);
    return out;
  }
  const ring::Shard shard = ring::shard_of(r.layout, rank, r.world, r.seqlen);
  const int d = r.head_dim, rows = static_cast<int>(shard.rows());
  std::vector<uint16_t> out(size_t(r.batch) * rows * heads * d);
  for (int b = 0; b < r.batch; ++b)
    for (int local = 0; local < rows; ++local)
      for (int h = 0; h < heads; ++h) {
        const uint16_t* from = &whole[((size_t(b) * r.seqlen + shard.global_row(local)) * heads + h) * d];
        const size_t to = r.head_major ? ((size_t(b) * heads + h) * rows + local) * d : ((size_t(b) * rows + local) * heads + h) * d;
        std::copy(from, from + d, &out[to]);
      }
  return out;
}

// The whole sequence's packed (batch, seqlen, heads, head_dim) tensor from every rank's shard, in
// the run's memory layout: shard_bits' inverse.
std::vector<uint16_t> unshard_bits(const RingRun& r, const std::vector<std::vector<uint16_t>>& shards, int heads) {
  const int d = r.head_dim;
  if (r.varlen()) {
    const size_t row_elements = size_t(heads) * d;
    std::vector<uint16_t> whole(size_t(shard_rows_of(r)) * r.world * row_elements);
    for (int rank = 0; rank < r.world; ++rank) {
      const std::vector<int64_t> rows = varlen_rows(r, rank);
      for (size_t i = 0; i < rows.size(); ++i)
        std::copy(&shards[rank][i * row_elements], &shards[rank][i * row_elements] + row_elements, &whole[rows[i] * row_elements]);
    }
    return whole;
  }
  std::vector<uint16_t> whole(size_t(r.batch) * r.seqlen * heads * d);
  for (int rank = 0; rank < r.world; ++rank) {
    const ring::Shard shard = ring::shard_of(r.layout, rank, r.world, r.seqlen);
    const int rows = static_cast<int>(shard.rows());
    for (int b = 0; b < r.batch; ++b)
      for (int local = 0; local < rows; ++local)
        for (int h = 0; h < heads; ++h) {
          const size_t from = r.head_major ? ((size_t(b) * heads + h) * rows + local) * d : ((size_t(b) * rows + local) * heads + h) * d;
          std::copy(&shards[rank][from], &shards[rank][from] + d,
                    &whole[((size_t(b) * r.seqlen + shard.global_row(local)) * heads + h) * d]);
        }
  }
  return whole;
}

ring::Options ring_options(const RingRun& r, CUstream stream) {
  ring::Options options;
  options.layout = r.layout;
  options.causal = r.causal;
  options.window_left = r.window_left;
  options.window_right = r.window_right;
  options.seqlens.assign(r.seqlens.begin(), r.seqlens.end());
  options.stream = stream;
  return options;
}

// An LSE shard's values in the whole batch's LSE ((batch, heads, seqlen), varlen (heads, total)).
void unshard_lse(const RingRun& r, int rank, const std::vector<float>& shard, std::vector<double>& whole) {
  const int rows = shard_rows_of(r);
  if (r.varlen()) {
    const std::vector<int64_t> map = varlen_rows(r, rank);
    const size_t total = map.size() * r.world;
    for (int h = 0; h < r.heads_q; ++h)
      for (int i = 0; i < rows; ++i) whole[h * total + map[i]] = shard[size_t(h) * rows + i];
    return;
  }
  const ring::Shard s = ring::shard_of(r.layout, rank, r.world, r.seqlen);
  for (int b = 0; b < r.batch; ++b)
    for (int h = 0; h < r.heads_q; ++h)
      for (int local = 0; local < rows; ++local)
        whole[(size_t(b) * r.heads_q + h) * r.seqlen + s.global_row(local)] = shard[(size_t(b) * r.heads_q + h) * rows + local];
}

// The LSE shard of `rank` from the whole batch's: unshard_lse's inverse.
std::vector<float> shard_lse(const RingRun& r, int rank, const std::vector<double>& whole) {
  const int rows = shard_rows_of(r);
  std::vector<float> shard(size_t(shard_batch(r)) * r.heads_q * rows);
  if (r.varlen()) {
    const std::vector<int64_t> map = varlen_rows(r, rank);
    const size_t total = map.size() * r.world;
    for (int h = 0; h < r.heads_q; ++h)
      for (int i = 0; i < rows; ++i) shard[size_t(h) * rows + i] = static_cast<float>(whole[h * total + map[i]]);
    return shard;
  }
  const ring::Shard s = ring::shard_of(r.layout, rank, r.world, r.seqlen);
  for (int b = 0; b < r.batch; ++b)
    for (int h = 0; h < r.heads_q; ++h)
      for (int local = 0; local < rows; ++local)
        shard[(size_t(b) * r.heads_q + h) * rows + local] =
            static_cast<float>(whole[(size_t(b) * r.heads_q + h) * r.seqlen + s.global_row(local)]);
  return shard;
}

TensorView lse_view(const RingRun& r, void* data) {
  const int rows = shard_rows_of(r);
  return r.varlen() ? TensorView::contiguous(data, ScalarType::float32, {r.heads_q, rows})
                    : TensorView::contiguous(data, ScalarType::float32, {r.batch, r.heads_q, rows});
}

AttentionShape whole_shape(const RingRun& r) {
  AttentionShape shape = AttentionShape::make(r.varlen() ? int(r.seqlens.size()) : r.batch, r.seqlen, r.seqlen, r.heads_q,
                                              r.heads_kv, r.head_dim);
  shape.seqlens_q = shape.seqlens_k = r.seqlens;
  shape.causal = r.causal;
  shape.window_left = r.window_left;
  shape.window_right = r.window_right;
  return shape;
}

// "N=4 zigzag causal window(64,0) bf16 ..." for the printed lines and the failure messages.
std::string describe(const RingRun& r) {
  std::string text = "N=" + std::to_string(r.world) + " " + ring::to_string(r.layout) + (r.causal ? " causal" : " full  ");
  if (r.window_left >= 0 || r.window_right >= 0)
    text += " window(" + std::to_string(r.window_left) + "," + std::to_string(r.window_right) + ")";
  std::string lengths = " s" + std::to_string(r.seqlen);
  if (r.varlen()) {
    lengths = " varlen s";
    for (size_t i = 0; i < r.seqlens.size(); ++i) lengths += (i ? "," : "") + std::to_string(r.seqlens[i]);
  }
  return text + " " + std::string(to_string(r.dtype)) + (r.varlen() ? "" : " b" + std::to_string(r.batch)) + lengths +
         " hq" + std::to_string(r.heads_q) + " hkv" + std::to_string(r.heads_kv) + " d" + std::to_string(r.head_dim) +
         (r.head_major ? " bhsd" : " bshd");
}

TensorView shard_view(const RingRun& r, void* data, int rows, int heads) {
  const ScalarType t = r.dtype == DType::bf16 ? ScalarType::bfloat16 : ScalarType::float16;
  if (r.varlen()) return TensorView::contiguous(data, t, {rows, heads, r.head_dim});
  return r.head_major ? TensorView::head_major(data, t, r.batch, rows, heads, r.head_dim)
                      : TensorView::contiguous(data, t, {r.batch, rows, heads, r.head_dim});
}

// Rows [begin, begin + rows) of a (batch, rows, heads, head_dim) view.
TensorView rows_of(TensorView t, int64_t begin, int64_t rows) {
  t.data = static_cast<char*>(t.data) + begin * t.strides[1] * element_size(t.dtype);
  t.shape[1] = rows;
  return t;
}

struct RankBuffers {
  std::unique_ptr<DeviceBuffer> q, k, v, out, lse;
};

// What a ring library on stock kernels computes: each step's calls run as plain flashjit calls
// whose O comes back in 16 bits, merged on the host in fp32 by the logsumexp rule (ring-flash-attn's
// update). Packed (batch, seqlen, heads, head_dim) as AttentionCase keeps its outputs.
std::vector<uint16_t> merge_16_bit_steps(const RingRun& r, const std::vector<RankBuffers>& ranks, int shard_rows) {
  const int d = r.head_dim;
  std::vector<uint16_t> merged(size_t(r.batch) * r.seqlen * r.heads_q * d);
  for (int rank = 0; rank < r.world; ++rank) {
    std::vector<float> out(size_t(r.batch) * shard_rows * r.heads_q * d, 0.f);  // (b, row, h, d)
    std::vector<float> lse(size_t(r.batch) * r.heads_q * shard_rows, -INFINITY);  // (b, h, row)
    for (int step = 0; step < r.world; ++step) {
      const int source = (rank - step + r.world) % r.world;
      for (const ring::StepCall& call : ring::step_calls(ring_options(r, nullptr), rank, source, r.world, shard_rows)) {
        const int rows = static_cast<int>(call.q_rows);
        DeviceBuffer part(size_t(r.batch) * rows * r.heads_q * d * 2), part_lse(size_t(r.batch) * r.heads_q * rows * 4);
        const TensorView part_view = TensorView::contiguous(
            part.get(), r.dtype == DType::bf16 ? ScalarType::bfloat16 : ScalarType::float16, {r.batch, rows, r.heads_q, d});
        const TensorView part_lse_view = TensorView::contiguous(part_lse.get(), ScalarType::float32, {r.batch, r.heads_q, rows});
        AttentionOptions options;
        options.causal = call.causal;
        options.window_left = call.window_left;
        options.window_right = call.window_right;
        test_runtime().forward(rows_of(shard_view(r, ranks[rank].q->get(), shard_rows, r.heads_q), call.q_begin, rows),
                               rows_of(shard_view(r, ranks[source].k->get(), shard_rows, r.heads_kv), call.kv_begin, call.kv_rows),
                               rows_of(shard_view(r, ranks[source].v->get(), shard_rows, r.heads_kv), call.kv_begin, call.kv_rows),
                               part_view, &part_lse_view, options);
        const auto part_bits = part.download<uint16_t>();
        const auto part_lses = part_lse.download<float>();
        for (int b = 0; b < r.batch; ++b)
          for (int h = 0; h < r.heads_q; ++h)
            for (int i = 0; i < rows; ++i) {
              const int row = static_cast<int>(call.q_begin) + i;
              float& running = lse[(size_t(b) * r.heads_q + h) * shard_rows + row];
              const float step_lse = part_lses[(size_t(b) * r.heads_q + h) * rows + i];
              const float high = std::max(running, step_lse);
              const float total = high + std::log(std::exp(running - high) + std::exp(step_lse - high));
              const float keep = std::exp(running - total), add = std::exp(step_lse - total);
              float* o = &out[((size_t(b) * shard_rows + row) * r.heads_q + h) * d];
              const uint16_t* p = &part_bits[((size_t(b) * rows + i) * r.heads_q + h) * d];
              for (int c = 0; c < d; ++c) o[c] = o[c] * keep + from_storage(r.dtype, p[c]) * add;
              running = total;
            }
      }
    }
    const ring::Shard shard = ring::shard_of(r.layout, rank, r.world, r.seqlen);
    for (int b = 0; b < r.batch; ++b)
      for (int local = 0; local < shard_rows; ++local)
        for (int h = 0; h < r.heads_q; ++h)
          for (int c = 0; c < d; ++c)
            merged[((size_t(b) * r.seqlen + shard.global_row(local)) * r.heads_q + h) * d + c] =
                to_storage(r.dtype, out[((size_t(b) * shard_rows + local) * r.heads_q + h) * d + c]);
  }
  return merged;
}

void check_ring(const RingRun& r, uint64_t seed) {
  const AttentionShape shape = whole_shape(r);
  AttentionCase whole(shape, r.dtype, seed);
  whole.run(test_runtime(), {});  // the single call on the whole sequence
  const double single_rms = rms_error(r.dtype, whole.output_bits(), whole.want_output());

  const int d = r.head_dim, shard_rows = shard_rows_of(r), batch = shard_batch(r);
  std::vector<RankBuffers> ranks(r.world);
  for (int rank = 0; rank < r.world; ++rank) {
    auto upload = [&](Role role, int heads) {
      const auto bits = shard_bits(r, whole.input_bits(role), heads, rank);
      auto buffer = std::make_unique<DeviceBuffer>(bits.size() * 2);
      buffer->upload(bits);
      return buffer;
    };
    ranks[rank].q = upload(Role::q, r.heads_q);
    ranks[rank].k = upload(Role::k, r.heads_kv);
    ranks[rank].v = upload(Role::v, r.heads_kv);
    ranks[rank].out = std::make_unique<DeviceBuffer>(size_t(batch) * shard_rows * r.heads_q * d * 2);
    ranks[rank].lse = std::make_unique<DeviceBuffer>(size_t(batch) * r.heads_q * shard_rows * 4);
    ranks[rank].out->poison();
    ranks[rank].lse->poison();
  }
  ring::LocalRing local(r.world);
  local.run([&](int rank, ring::Transport& transport) {
    detail::make_context_current(0);
    CUstream stream = nullptr;
    FLASHJIT_CU(cuStreamCreate, &stream, CU_STREAM_NON_BLOCKING);
    const RankBuffers& b = ranks[rank];
    const TensorView lse = lse_view(r, b.lse->get());
    const ring::Options options = ring_options(r, stream);
    ring::forward(test_runtime(), transport, shard_view(r, b.q->get(), shard_rows, r.heads_q),
                  shard_view(r, b.k->get(), shard_rows, r.heads_kv), shard_view(r, b.v->get(), shard_rows, r.heads_kv),
                  shard_view(r, b.out->get(), shard_rows, r.heads_q), &lse, options);
    FLASHJIT_CU(cuStreamSynchronize, stream);
    FLASHJIT_CU(cuStreamDestroy, stream);
  });

  // Unshard into the whole sequence's packed rows.
  std::vector<std::vector<uint16_t>> outs;
  for (const RankBuffers& b : ranks) outs.push_back(b.out->download<uint16_t>());
  const std::vector<uint16_t> got = unshard_bits(r, outs, r.heads_q);
  std::vector<double> got_lse(whole.want_lse().size());
  for (int rank = 0; rank < r.world; ++rank) unshard_lse(r, rank, ranks[rank].lse->download<float>(), got_lse);
  const double ring_rms = rms_error(r.dtype, got, whole.want_output());
  // (the 16-bit contrast replays dense steps only)
  const double rounded_rms = r.varlen() ? NAN : rms_error(r.dtype, merge_16_bit_steps(r, ranks, shard_rows), whole.want_output());
  std::printf("ring %s: RMS error vs float64 %.3g (single call %.3g, 16-bit steps merged %.3g)\n", describe(r).c_str(),
              ring_rms, single_rms, rounded_rms);
  INFO("ring " << describe(r));
  const Comparison output = compare_output(shape, r.dtype, got, whole.want_output(), whole.want_magnitude(),
                                           tensor_core_output_tolerance(r.dtype));
  INFO(output.first_bad << " (" << output.bad << " of " << output.checked << " elements; worst " << output.worst_head
                        << " " << output.worst_head_rms << ")");
  CHECK(output.ok());
  Comparison lse;
  for (size_t i = 0; i < got_lse.size(); ++i)
    if (!std::isnan(whole.want_lse()[i]))
      compare(lse, got_lse[i], whole.want_lse()[i], tensor_core_lse_tolerance(), [&] { return "lse[" + std::to_string(i) + "]"; });
  INFO(lse.first_bad);
  CHECK(lse.bad == 0);
  CHECK(ring_rms <= 1.2 * single_rms);
}

// The backward over the ranks (ring::backward, fed the reference forward's O and LSE as the single
// call is): dq, dk and dv, unsharded, against the float64 reference gradients, with an RMS error at
// most 1.2x the single call's.
void check_ring_backward(const RingRun& r, uint64_t seed) {
  const AttentionShape shape = whole_shape(r);
  BackwardCase whole(shape, r.dtype, seed);
  whole.run(test_runtime(), {});
  const GradientTolerance tolerance = tensor_core_gradient_tolerance(r.dtype);
  REQUIRE(whole.check(tolerance).ok());  // the single call
  const std::vector<double> single = whole.gradient_rms_errors(whole.dq_bits(), whole.dk_bits(), whole.dv_bits());

  const int d = r.head_dim, shard_rows = shard_rows_of(r), batch = shard_batch(r);
  struct Rank {
    std::unique_ptr<DeviceBuffer> q, k, v, out, dout, lse, dq, dk, dv;
  };
  std::vector<Rank> ranks(r.world);
  for (int rank = 0; rank < r.world; ++rank) {
    auto upload = [&](const std::vector<uint16_t>& whole_bits, int heads) {
      const auto bits = shard_bits(r, whole_bits, heads, rank);
      auto buffer = std::make_unique<DeviceBuffer>(bits.size() * 2);
      buffer->upload(bits);
      return buffer;
    };
    Rank& b = ranks[rank];
    b.q = upload(whole.input_bits(Role::q), r.heads_q);
    b.k = upload(whole.input_bits(Role::k), r.heads_kv);
    b.v = upload(whole.input_bits(Role::v), r.heads_kv);
    b.dout = upload(whole.input_bits(Role::other), r.heads_q);
    b.out = upload(whole.reference_out_bits(), r.heads_q);
    const std::vector<float> lse = shard_lse(r, rank, whole.reference_lse());
    b.lse = std::make_unique<DeviceBuffer>(lse.size() * 4);
    b.lse->upload(lse);
    b.dq = std::make_unique<DeviceBuffer>(size_t(batch) * shard_rows * r.heads_q * d * 2);
    b.dk = std::make_unique<DeviceBuffer>(size_t(batch) * shard_rows * r.heads_kv * d * 2);
    b.dv = std::make_unique<DeviceBuffer>(size_t(batch) * shard_rows * r.heads_kv * d * 2);
    for (DeviceBuffer* g : {b.dq.get(), b.dk.get(), b.dv.get()}) g->poison();
  }
  ring::LocalRing local(r.world);
  local.run([&](int rank, ring::Transport& transport) {
    detail::make_context_current(0);
    CUstream stream = nullptr;
    FLASHJIT_CU(cuStreamCreate, &stream, CU_STREAM_NON_BLOCKING);
    const Rank& b = ranks[rank];
    const ring::Options options = ring_options(r, stream);
    const TensorView lse = lse_view(r, b.lse->get());
    auto qs = [&](const DeviceBuffer& m) { return shard_view(r, m.get(), shard_rows, r.heads_q); };
    auto ks = [&](const DeviceBuffer& m) { return shard_view(r, m.get(), shard_rows, r.heads_kv); };
    ring::backward(test_runtime(), transport, qs(*b.q), ks(*b.k), ks(*b.v), qs(*b.out), qs(*b.dout), lse, qs(*b.dq),
                   ks(*b.dk), ks(*b.dv), options);
    FLASHJIT_CU(cuStreamSynchronize, stream);
    FLASHJIT_CU(cuStreamDestroy, stream);
  });
  std::vector<std::vector<uint16_t>> dqs, dks, dvs;
  for (const Rank& b : ranks) {
    dqs.push_back(b.dq->download<uint16_t>());
    dks.push_back(b.dk->download<uint16_t>());
    dvs.push_back(b.dv->download<uint16_t>());
  }
  const auto dq = unshard_bits(r, dqs, r.heads_q), dk = unshard_bits(r, dks, r.heads_kv), dv = unshard_bits(r, dvs, r.heads_kv);
  const std::vector<double> ring_errors = whole.gradient_rms_errors(dq, dk, dv);
  std::printf("ring backward %s: RMS error of dq/dk/dv %.3g %.3g %.3g (single call %.3g %.3g %.3g)\n", describe(r).c_str(),
              ring_errors[0], ring_errors[1], ring_errors[2], single[0], single[1], single[2]);
  INFO("ring backward " << describe(r));
  const GradientComparison c = whole.check_gradients(dq, dk, dv, tolerance);
  INFO("dq: " << c.dq.first_bad << "; dk: " << c.dk.first_bad << "; dv: " << c.dv.first_bad);
  CHECK(c.ok());
  for (int i = 0; i < 3; ++i) CHECK(ring_errors[i] <= 1.2 * single[i]);
}

// 2, 4 and 8 ranks, contiguous and zigzag, causal and not, with a seed offset of its own each.
std::vector<std::pair<RingRun, int>> ring_grid() {
  std::vector<std::pair<RingRun, int>> runs;
  for (int world : {2, 4, 8})
    for (ring::Layout layout : {ring::Layout::contiguous, ring::Layout::zigzag})
      for (bool causal : {false, true}) {
        RingRun r;
        r.world = world;
        r.layout = layout;
        r.causal = causal;
        r.seqlen = world * 144;
        runs.push_back({r, world * 4 + int(layout) * 2 + causal});
      }
  return runs;
}

// 4 ranks, head dim 64, fp16, GQA 4 (8 query heads on 2).
RingRun fp16_gqa_d64() {
  RingRun r;
  r.world = 4;
  r.seqlen = 4 * 2 * 100;
  r.head_dim = 64;
  r.dtype = DType::fp16;
  r.heads_q = 8;
  r.heads_kv = 2;
  return r;
}

}  // namespace

TEST_CASE("ring backward: 2, 4 and 8 ranks, contiguous and zigzag, causal and not", "[ring][backward]") {
  if (!hopper_or_skip("ring attention needs an sm_90 device")) return;
  for (const auto& [r, seed] : ring_grid()) check_ring_backward(r, 4000 + seed);
}

TEST_CASE("ring backward: head dims 64 and 256, fp16, GQA 4, head-major shards", "[ring][backward]") {
  if (!hopper_or_skip("ring attention needs an sm_90 device")) return;
  check_ring_backward(fp16_gqa_d64(), 41);
  RingRun b;
  b.world = 2;
  b.seqlen = 2 * 2 * 96;
  b.head_dim = 256;
  b.batch = 1;
  b.head_major = true;
  check_ring_backward(b, 42);
}

TEST_CASE("ring: zigzag causal over 2 and 4 virtual ranks, forward and backward", "[ring][quick]") {
  if (!hopper_or_skip("ring attention needs an sm_90 device")) return;
  for (int world : {2, 4}) {
    RingRun r;
    r.world = world;
    r.seqlen = world * 2 * 72;  // chunks of 72 rows: no tile boundary lines up
    check_ring(r, 1000 + world);
    if (world == 2) check_ring_backward(r, 1100);
  }
}

TEST_CASE("ring: 2, 4 and 8 ranks, contiguous and zigzag, causal and not", "[ring]") {
  if (!hopper_or_skip("ring attention needs an sm_90 device")) return;
  for (const auto& [r, seed] : ring_grid()) check_ring(r, 2000 + seed);
}

TEST_CASE("ring: head dims 64 and 256, fp16, MQA and GQA 4, head-major shards", "[ring]") {
  if (!hopper_or_skip("ring attention needs an sm_90 device")) return;
  check_ring(fp16_gqa_d64(), 31);
  RingRun b;
  b.world = 2;
  b.layout = ring::Layout::contiguous;
  b.seqlen = 2 * 200;
  b.head_dim = 256;
  b.heads_kv = 1;
  b.batch = 1;
  check_ring(b, 32);
  RingRun c;
  c.world = 8;
  c.seqlen = 8 * 2 * 40;
  c.head_major = true;
  c.batch = 3;
  check_ring(c, 33);
}

// Windows: causal with a left window (the sliding-window models'), and two-sided ones, of widths
// that end inside a chunk, span several, or reach past the sequence; forward and backward.
TEST_CASE("ring: sliding windows over contiguous and zigzag shards, forward and backward", "[ring][window]") {
  if (!hopper_or_skip("ring attention needs an sm_90 device")) return;
  struct Window {
    int world;
    ring::Layout layout;
    bool causal;
    int left, right;
  };
  const Window windows[] = {{4, ring::Layout::zigzag, true, 100, 0},       {4, ring::Layout::contiguous, true, 300, 0},
                            {8, ring::Layout::zigzag, true, 40, 0},        {2, ring::Layout::zigzag, false, 90, 30},
                            {4, ring::Layout::contiguous, false, 64, 200}, {2, ring::Layout::zigzag, true, 5000, 0}};
  uint64_t seed = 5000;
  for (const Window& w : windows) {
    RingRun r;
    r.world = w.world;
    r.layout = w.layout;
    r.causal = w.causal;
    r.window_left = w.left;
    r.window_right = w.right;
    r.seqlen = w.world * 2 * 72;
    check_ring(r, ++seed);
    check_ring_backward(r, ++seed);
  }
}

// Varlen: packed sequences of different lengths, each split into the layout's chunks on every
// rank; forward and backward against one varlen call over the whole batch.
TEST_CASE("ring: varlen shards over contiguous and zigzag layouts, forward and backward", "[ring][varlen]") {
  if (!hopper_or_skip("ring attention needs an sm_90 device")) return;
  struct Varlen {
    int world;
    ring::Layout layout;
    bool causal;
    std::vector<int> seqlens;
    int head_dim;
  };
  const Varlen runs[] = {{2, ring::Layout::zigzag, true, {4 * 50, 4 * 9, 4 * 130}, 128},
                         {4, ring::Layout::zigzag, true, {8 * 40, 8 * 3, 8 * 72, 8 * 17}, 128},
                         {4, ring::Layout::contiguous, false, {4 * 100, 4 * 33}, 64},
                         {8, ring::Layout::zigzag, false, {16 * 20, 16 * 37}, 128}};
  uint64_t seed = 6000;
  for (const Varlen& v : runs) {
    RingRun r;
    r.world = v.world;
    r.layout = v.layout;
    r.causal = v.causal;
    r.seqlens = v.seqlens;
    r.head_dim = v.head_dim;
    check_ring(r, ++seed);
    check_ring_backward(r, ++seed);
  }
}

TEST_CASE("ring: shards that differ between ranks are refused on every rank, no hang", "[ring][quick]") {
  if (!hopper_or_skip("ring attention needs an sm_90 device")) return;
  const int world = 3, rows = 64, heads = 2, d = 64;
  std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  for (int rank = 0; rank < world; ++rank) buffers.push_back(std::make_unique<DeviceBuffer>(size_t(rows + 2) * heads * d * 2));
  ring::LocalRing local(world);
  std::vector<std::string> messages(world);
  REQUIRE_THROWS_WITH(local.run([&](int rank, ring::Transport& transport) {
                        detail::make_context_current(0);
                        const int shard_rows = rank == 1 ? rows + 2 : rows;  // rank 1 holds more rows
                        const TensorView t = TensorView::contiguous(buffers[rank]->get(), ScalarType::bfloat16,
                                                                    {1, shard_rows, heads, d});
                        try {
                          ring::forward(test_runtime(), transport, t, t, t, t, nullptr, {});
                        } catch (const Error& e) {
                          messages[rank] = e.what();
                          throw;
                        }
                      }),
                      Catch::Contains("shard rows"));
  for (int rank = 0; rank < world; ++rank) {
    INFO("rank " << rank << ": " << messages[rank]);
    CHECK(messages[rank].find("shard rows") != std::string::npos);
  }
}
