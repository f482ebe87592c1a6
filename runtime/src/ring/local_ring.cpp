// LocalRing: N virtual ranks on one GPU, each on its own host thread, moving data by device copies
// ordered with events. A collective runs in two rendezvous: every rank posts its buffers (with an
// event its data is ready at), then each copies what it receives on its own stream and records
// that; once all have, a sender's stream waits for its receivers' copies (as NCCL's send completes
// in stream order only once the peer has the data). Posts and events alternate between two sets by
// round parity: a rank reaches round k + 2 only after every rank has finished round k.
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "../driver.hpp"
#include "flashjit/ring.hpp"

namespace flashjit::ring {

namespace {

struct Post {
  const void* send = nullptr;
  void* recv = nullptr;
  size_t bytes = 0;
};

// Thrown in the ranks still waiting when another rank failed (run() reports the first failure).
struct Aborted : Error {
  Aborted() : Error(ErrorCode::internal, "ring", "another rank of the local ring failed") {}
};

}  // namespace

struct LocalRing::Impl {
  class Endpoint : public Transport {
   public:
    Endpoint(Impl& ring, int rank) : ring_(ring), rank_(rank) {}
    ~Endpoint() override {
      if (!detail::driver_available()) return;
      for (int parity = 0; parity < 2; ++parity)
        for (CUevent event : {ready_[parity], copied_[parity]})
          if (event != nullptr) detail::driver().cuEventDestroy(event);
    }
    int rank() const override { return rank_; }
    int size() const override { return ring_.world; }
    void shift(const void* send, void* recv, size_t bytes, void* stream) override {
      collective(send, recv, bytes, static_cast<CUstream>(stream), /*gather=*/false);
    }
    void all_gather(const void* send, void* recv, size_t bytes, void* stream) override {
      collective(send, recv, bytes, static_cast<CUstream>(stream), /*gather=*/true);
    }
    void restart() { round_ = 0; }
    CUevent ready(int parity) const { return ready_[parity]; }
    CUevent copied(int parity) const { return copied_[parity]; }

   private:
    void collective(const void* send, void* recv, size_t bytes, CUstream stream, bool gather) {
      const int parity = static_cast<int>(round_++ % 2), world = ring_.world;
      if (ready_[parity] == nullptr) {  // (created here, in the rank's thread, with its context current)
        FLASHJIT_CU(cuEventCreate, &ready_[parity], CU_EVENT_DISABLE_TIMING);
        FLASHJIT_CU(cuEventCreate, &copied_[parity], CU_EVENT_DISABLE_TIMING);
      }
      FLASHJIT_CU(cuEventRecord, ready_[parity], stream);
      ring_.posts[parity][rank_] = {send, recv, bytes};
      ring_.rendezvous();
      const int previous = (rank_ + world - 1) % world, next = (rank_ + 1) % world;
      for (int source = 0; source < world; ++source) {
        if (!gather && source != previous) continue;
        const Post& from = ring_.posts[parity][source];
        if (from.bytes != bytes)
          throw Error(ErrorCode::invalid_argument, "ring",
                      fmt::format("rank {} {} {} bytes but rank {} {}", source, gather ? "gathers" : "sends", from.bytes,
                                  rank_, bytes));
        FLASHJIT_CU(cuStreamWaitEvent, stream, ring_.endpoints[source]->ready(parity), 0);
        auto* destination = static_cast<char*>(recv) + (gather ? source * bytes : 0);
        if (bytes > 0)
          FLASHJIT_CU(cuMemcpyDtoDAsync, reinterpret_cast<CUdeviceptr>(destination),
                      reinterpret_cast<CUdeviceptr>(from.send), bytes, stream);
      }
      FLASHJIT_CU(cuEventRecord, copied_[parity], stream);
      ring_.rendezvous();
      for (int reader = 0; reader < world; ++reader)
        if (gather || reader == next) FLASHJIT_CU(cuStreamWaitEvent, stream, ring_.endpoints[reader]->copied(parity), 0);
    }

    Impl& ring_;
    int rank_;
    long long round_ = 0;
    CUevent ready_[2] = {nullptr, nullptr}, copied_[2] = {nullptr, nullptr};
  };

  int world;
  std::vector<std::unique_ptr<Endpoint>> endpoints;
  std::vector<Post> posts[2];
  std::mutex mutex;
  std::condition_variable changed;
  int arrived = 0;
  long long generation = 0;
  bool aborted = false;

  explicit Impl(int world_size) : world(world_size) {
    for (int r = 0; r < world; ++r) endpoints.push_back(std::make_unique<Endpoint>(*this, r));
    posts[0].resize(world);
    posts[1].resize(world);
  }

  // Returns once every rank has arrived (throws Aborted if a rank failed meanwhile).
  void rendezvous() {
    std::unique_lock<std::mutex> lock(mutex);
    if (aborted) throw Aborted();
    const long long mine = generation;
    if (++arrived == world) {
      arrived = 0;
      ++generation;
      changed.notify_all();
      return;
    }
    changed.wait(lock, [&] { return generation != mine || aborted; });
    if (generation == mine) throw Aborted();
  }

  void abort() {
    std::lock_guard<std::mutex> lock(mutex);
    aborted = true;
    changed.notify_all();
  }

  // The ranks' threads, started on the first run and kept (a run is one ring call: spawning N
  // threads per call cost more than a short call's GPU time). Each waits for the next job.
  std::vector<std::thread> workers;
  std::mutex job_mutex;
  std::condition_variable job_changed;
  const std::function<void(int, Transport&)>* job = nullptr;
  long long job_number = 0;
  int job_running = 0;
  bool stopping = false;
  std::exception_ptr first_error;

  void work(int rank) {
    long long done = 0;
    for (;;) {
      const std::function<void(int, Transport&)>* body = nullptr;
      {
        std::unique_lock<std::mutex> lock(job_mutex);
        job_changed.wait(lock, [&] { return stopping || job_number != done; });
        if (stopping) return;
        done = job_number;
        body = job;
      }
      try {
        (*body)(rank, *endpoints[rank]);
      } catch (const Aborted&) {
        // (another rank's failure, reported by that rank)
      } catch (...) {
        {
          std::lock_guard<std::mutex> lock(job_mutex);
          if (!first_error) first_error = std::current_exception();
        }
        abort();
      }
      std::lock_guard<std::mutex> lock(job_mutex);
      if (--job_running == 0) job_changed.notify_all();
    }
  }

  void run(const std::function<void(int, Transport&)>& body) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      aborted = false;
      arrived = 0;
    }
    for (auto& endpoint : endpoints) endpoint->restart();  // (a failed run may have left them apart)
    std::unique_lock<std::mutex> lock(job_mutex);
    if (job_running != 0) throw Error(ErrorCode::invalid_argument, "ring", "LocalRing::run is already running");
    if (workers.empty())
      for (int r = 0; r < world; ++r) workers.emplace_back([this, r] { work(r); });
    first_error = nullptr;
    job = &body;
    job_running = world;
    ++job_number;
    job_changed.notify_all();
    job_changed.wait(lock, [&] { return job_running == 0; });
    if (first_error) std::rethrow_exception(first_error);
  }

  ~Impl() {
    {
      std::lock_guard<std::mutex> lock(job_mutex);
      stopping = true;
      job_changed.notify_all();
    }
    for (std::thread& t : workers) t.join();
  }
};

LocalRing::LocalRing(int world) {
  if (world < 1 || world > 64)
    throw Error(ErrorCode::invalid_argument, "ring", fmt::format("a local ring of {} ranks: expected 1 to 64", world));
  impl_ = std::make_unique<Impl>(world);
}
LocalRing::~LocalRing() = default;

int LocalRing::size() const { return impl_->world; }

Transport& LocalRing::endpoint(int rank) {
  if (rank < 0 || rank >= impl_->world)
    throw Error(ErrorCode::invalid_argument, "ring", fmt::format("rank {} is outside the ring's 0 .. {}", rank, impl_->world - 1));
  return *impl_->endpoints[rank];
}

void LocalRing::run(const std::function<void(int rank, Transport& transport)>& body) { impl_->run(body); }

}  // namespace flashjit::ring
