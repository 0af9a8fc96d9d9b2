// The persistent CPU worker pool that runs the generated expert kernels.
// Fixed code, shipped with the runtime and compiled together with each engine's kernels.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace ftc {

using JobFn = void (*)(int tid, int n_threads, void* ctx);

// A fixed set of threads, each pinned to one core, running one job at a time.
// The calling thread takes part as thread 0, so a job on n threads wakes n - 1 workers.
// Idle workers spin briefly (a decode step calls in every MoE layer) and then sleep on a futex,
// so an idle engine does not burn its cores.
class WorkerPool {
 public:
  WorkerPool(int n_threads, const int* cpus);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int size() const { return n_; }
  // Runs fn(tid, n, ctx) on every thread; returns when all of them have finished.
  void run(JobFn fn, void* ctx);
  // Waits until every thread of the running job has reached this barrier.
  void barrier();

 private:
  void worker_loop(int tid, int cpu);

  int n_;
  std::vector<std::thread> threads_;
  JobFn fn_ = nullptr;
  void* ctx_ = nullptr;
  bool stop_ = false;
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<int> pending_{0};
  alignas(64) std::atomic<int> barrier_count_{0};
  alignas(64) std::atomic<uint32_t> barrier_phase_{0};
};

}  // namespace ftc

extern "C" {
void* ftc_pool_create(int n_threads, const int* cpus);
void ftc_pool_destroy(void* pool);
int ftc_pool_size(void* pool);
}
