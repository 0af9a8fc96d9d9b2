#include "worker_pool.h"

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <chrono>

namespace ftc {

namespace {
// How long an idle worker spins before it sleeps on a futex, in TSC cycles (about 200 µs at
// 2.5 GHz). A futex wake-up of 15 threads costs tens of µs, more in a VM whose idle vCPUs halt,
// so back-to-back calls must find the workers awake; a longer spin would take cores from torch's
// own threads between MoE layers. Counted in cycles, not pause instructions, because a pause
// lasts 10 cycles on some cores and 140 on others.
constexpr uint64_t kSpinCycles = 500000;
// Background pools (a GPU engine's) own their cores, and decode calls them only in the layers
// that have CPU misses: with locality that is a few layers per token, far apart, so a short spin
// put every job behind a wake-up (on the device, under one CPU expert per layer cost 0.3-0.44 ms
// per layer). They spin about 40 ms, longer than a decode token, and sleep only between requests.
constexpr uint64_t kBackgroundSpinCycles = 100000000;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void pin_to_cpu(pthread_t thread, int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(thread, sizeof(set), &set);  // best effort: a failed pin only costs speed
}
}  // namespace

WorkerPool::WorkerPool(int n_threads, const int* cpus, bool caller_joins)
    : n_(n_threads < 1 ? 1 : n_threads),
      caller_joins_(caller_joins),
      spin_cycles_(caller_joins ? kSpinCycles : kBackgroundSpinCycles) {
  threads_.reserve(n_);
  for (int tid = caller_joins_ ? 1 : 0; tid < n_; ++tid) {
    threads_.emplace_back(&WorkerPool::worker_loop, this, tid, cpus ? cpus[tid] : -1);
  }
}

WorkerPool::~WorkerPool() {
  stop_ = true;
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  for (auto& t : threads_) t.join();
}

void WorkerPool::worker_loop(int tid, int cpu) {
  pin_to_cpu(pthread_self(), cpu);
  uint64_t seen = 0;
  for (;;) {
    uint64_t g;
    const uint64_t spin_start = __rdtsc();
    while ((g = generation_.load(std::memory_order_acquire)) == seen) {
      if (__rdtsc() - spin_start < spin_cycles_) {
        _mm_pause();
      } else {
        generation_.wait(seen, std::memory_order_acquire);
      }
    }
    seen = g;
    if (stop_) return;
    fn_(tid, n_, ctx_);
    stamp_end();
    // The last thread signals before it reports done, so that wait() never returns before the
    // signal (a later job's signal could otherwise be overwritten by this one's).
    if (end_flag_ != nullptr && signal_pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      signal(end_flag_, end_value_);
    }
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void WorkerPool::wake(JobFn fn, void* ctx, uint64_t* end_flag, uint64_t end_value) {
  const int64_t t = now_ns();
  job_start_ns_.store(t, std::memory_order_relaxed);
  job_end_ns_.store(t, std::memory_order_relaxed);
  fn_ = fn;
  ctx_ = ctx;
  end_flag_ = end_flag;
  end_value_ = end_value;
  signal_pending_.store(static_cast<int>(threads_.size()), std::memory_order_relaxed);
  pending_.store(static_cast<int>(threads_.size()), std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
}

void WorkerPool::run(JobFn fn, void* ctx) {
  wake(fn, ctx);
  if (caller_joins_) fn(0, n_, ctx);
  if (caller_joins_) stamp_end();
  wait();
}

void WorkerPool::start(JobFn fn, void* ctx) {
  if (caller_joins_) {  // thread 0's share would have no thread: run it here instead
    run(fn, ctx);
    return;
  }
  wake(fn, ctx);
}

void WorkerPool::start_signaled(JobFn fn, void* ctx, uint64_t* flag, uint64_t value) {
  if (caller_joins_) {
    run(fn, ctx);
    signal(flag, value);
    return;
  }
  wake(fn, ctx, flag, value);
}

void WorkerPool::signal(uint64_t* flag, uint64_t value) {
  std::atomic_ref<uint64_t>(*flag).store(value, std::memory_order_release);
}

void WorkerPool::wait() {
  while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
}

void WorkerPool::stamp_end() {
  // The job's end is its last thread's: each thread raises it to its own end before it reports
  // done (the release that wait() acquires), so a finished job's end is never read half-stamped.
  const int64_t t = now_ns();
  int64_t seen = job_end_ns_.load(std::memory_order_relaxed);
  while (seen < t && !job_end_ns_.compare_exchange_weak(seen, t, std::memory_order_relaxed)) {
  }
}

double WorkerPool::job_seconds() const {
  return static_cast<double>(job_end_ns_.load(std::memory_order_relaxed) -
                             job_start_ns_.load(std::memory_order_relaxed)) * 1e-9;
}

void WorkerPool::barrier() {
  // Sense-reversing barrier: the phase cannot advance before this thread has arrived.
  const uint32_t phase = barrier_phase_.load(std::memory_order_acquire);
  if (barrier_count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
    barrier_count_.store(0, std::memory_order_relaxed);
    barrier_phase_.fetch_add(1, std::memory_order_release);
  } else {
    while (barrier_phase_.load(std::memory_order_acquire) == phase) _mm_pause();
  }
}

}  // namespace ftc

extern "C" {
void* ftc_pool_create(int n_threads, const int* cpus, int caller_joins) {
  return new ftc::WorkerPool(n_threads, cpus, caller_joins != 0);
}
void ftc_pool_wait(void* pool) { static_cast<ftc::WorkerPool*>(pool)->wait(); }
void ftc_pool_destroy(void* pool) { delete static_cast<ftc::WorkerPool*>(pool); }
int ftc_pool_size(void* pool) { return static_cast<ftc::WorkerPool*>(pool)->size(); }
double ftc_pool_job_seconds(void* pool) { return static_cast<ftc::WorkerPool*>(pool)->job_seconds(); }
}
