// A small pool of helper threads for the quantized decode step in kvboost-server (kvb::parallel_chunks in
// cpu_quant.cpp says when it runs), where the calling thread never waits for a helper that has not started.
//
// Why not at::parallel_for (OpenMP): an OpenMP region splits its range into one fixed part per thread and ends in a
// barrier, so the step waits for the slowest thread at each of the ~150 regions of a step. In kvboost-server on 2
// cores, the HTTP threads and the client share those cores with the two compute threads: a thread the OS has
// descheduled stalls every region it is part of. Measured there (AMD Zen 4, 2 cores, bundled model, one client):
// a 1-row decode step took ~12 ms in the server against 5.7 ms alone, and the server's inter-token latency was 9.4
// ms with one OpenMP thread against 14 ms with two.
//
// Here each participant owns a contiguous part of the range and, when its part is done, claims chunks of the
// others' parts; the caller waits only for chunks that a helper has claimed and not finished. A helper that is not
// running when a job starts claims nothing, and the caller does its share. Every chunk is computed by one thread with the same code whichever
// thread that is, so results do not depend on the scheduling.
//
// Helpers spin for a short while after a job (the next product of a step follows within microseconds) and then
// sleep on a condition variable. In a forked child the parent's helpers do not exist: the pool is rebuilt there
// (a job run before that would still complete, by the caller alone).
#pragma once

#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvb {

class WorkPool {
 public:
  using Body = std::function<void(int64_t, int64_t)>;

  // Runs body(begin, end) over [0, n) in chunks of `chunk`, on the calling thread and up to `threads` - 1 helpers.
  // Each participant owns a contiguous part of the range (weights then stream in order, as with a static split)
  // and, when its part is done, takes chunks of the others' parts. One job at a time: a second thread calling
  // meanwhile runs its range alone.
  void run(int64_t n, int64_t chunk, int64_t threads, const Body& body) {
    if (n <= 0) return;
    chunk = std::max<int64_t>(1, chunk);
    const int64_t parts = std::min<int64_t>({threads, (n + chunk - 1) / chunk, kMaxParts});
    std::unique_lock<std::mutex> job(job_mutex_, std::try_to_lock);
    if (parts <= 1 || !job.owns_lock() || n > kMaxIndex) {
      body(0, n);
      return;
    }
    ensure_helpers(parts - 1);
    // Publish the job: its fields and every part's claim word, then the generation.
    const uint64_t gen = (generation_.load(std::memory_order_relaxed) + 1) & kGenMask;
    body_ = &body;
    chunk_.store(chunk, std::memory_order_relaxed);
    parts_.store(parts, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    for (int64_t p = 0; p < parts; ++p)
      slots_[p].claim.store(pack(gen, p * n / parts, (p + 1) * n / parts), std::memory_order_release);
    generation_.store(gen, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    const int64_t mine = work(gen, 0);
    // Wait only for chunks claimed by helpers that are still being computed.
    int64_t spins = 0;
    while (done_.load(std::memory_order_acquire) + mine < n) {
      if (++spins > 4096) std::this_thread::yield();
      else _mm_pause();
    }
  }

  // The process's pool. Never destroyed: at exit its helpers still wait on its condition variable (destroying it
  // would block), and a forked child gets a new one (the parent's copy is left as it is).
  static WorkPool& instance() {
    static WorkPool* pool = nullptr;
    static pid_t owner = 0;
    static std::mutex guard;
    std::lock_guard<std::mutex> lock(guard);
    if (pool == nullptr || owner != getpid()) {
      pool = new WorkPool();
      owner = getpid();
    }
    return *pool;
  }

 private:
  // A part's claim word: generation (20 bits) | next index (22) | end (22). One word, so a claim validated by its
  // compare-exchange always belongs to the job it read (a helper late by a job fails the exchange).
  static constexpr uint64_t kGenMask = (uint64_t{1} << 20) - 1;
  static constexpr int64_t kMaxIndex = (int64_t{1} << 22) - 1;
  static constexpr int64_t kMaxParts = 64;
  static uint64_t pack(uint64_t gen, int64_t next, int64_t end) {
    return (gen << 44) | (static_cast<uint64_t>(next) << 22) | static_cast<uint64_t>(end);
  }

  // Claims and runs chunks of job `gen`, its own part `self` first, then the others'; returns the indices it ran.
  int64_t work(uint64_t gen, int64_t self) {
    int64_t ran = 0;
    const int64_t parts = parts_.load(std::memory_order_relaxed), chunk = chunk_.load(std::memory_order_relaxed);
    for (int64_t k = 0; k < parts; ++k) {
      std::atomic<uint64_t>& claim = slots_[(self + k) % parts].claim;
      for (;;) {
        uint64_t c = claim.load(std::memory_order_acquire);
        if ((c >> 44) != gen) return ran;  // a later job: this one is over
        const int64_t next = static_cast<int64_t>((c >> 22) & kMaxIndex), end = static_cast<int64_t>(c & kMaxIndex);
        if (next >= end) break;
        const int64_t stop = std::min(end, next + chunk);
        if (!claim.compare_exchange_weak(c, pack(gen, stop, end), std::memory_order_acq_rel)) continue;
        // The claim succeeded while the job was unfinished, so the caller is still waiting and its fields hold.
        (*body_)(next, stop);
        ran += stop - next;
      }
    }
    return ran;
  }

  void ensure_helpers(int64_t helpers) {
    while (static_cast<int64_t>(threads_.size()) < helpers) {
      const int64_t id = static_cast<int64_t>(threads_.size());
      threads_.emplace_back([this, id] { helper(id + 1); });
      threads_.back().detach();
    }
  }

  void helper(int64_t self) {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      uint64_t gen = generation_.load(std::memory_order_acquire);
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
      for (int64_t i = 0; gen == seen; ++i) {  // spin a while: a step's next product follows within microseconds
        _mm_pause();
        if ((i & 255) == 255 && std::chrono::steady_clock::now() > until) break;
        gen = generation_.load(std::memory_order_acquire);
      }
      if (gen == seen) {  // then sleep until a job is published
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        continue;
      }
      seen = gen;
      // parts_ of a later job (a stale read) only makes this helper skip or join that job: the claims keep it right.
      if (self >= parts_.load(std::memory_order_relaxed)) continue;
      const int64_t ran = work(gen, self);
      if (ran) done_.fetch_add(ran, std::memory_order_acq_rel);
    }
  }

  // Helpers spin this long after a job before they sleep: about as long as the gap between two decode steps in
  // kvboost-server, so a step's first product finds them awake (measured with a first version of the pool, one
  // client: 7.6 ms between tokens with 3 ms, 9.2 ms with 100 us).
  static constexpr int64_t kSpinMicros = 3000;
  struct alignas(64) Slot {
    std::atomic<uint64_t> claim{0};
  };
  Slot slots_[kMaxParts];
  std::vector<std::thread> threads_;
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  std::atomic<int64_t> sleepers_{0};
  const Body* body_ = nullptr;
  // Written before the generation is published (release), read after it is seen (acquire); relaxed suffices.
  std::atomic<int64_t> chunk_{1}, parts_{0};
  std::mutex mutex_, job_mutex_;
  std::condition_variable wake_;
};

}  // namespace kvb
