// The persistent CPU worker pool that runs the generated expert kernels.
// Fixed code, shipped with the runtime and compiled together with each engine's kernels.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace ftc {

using JobFn = void (*)(int tid, int n_threads, void* ctx);

// A fixed set of threads, each pinned to one core, running one job of n threads at a time.
// With caller_joins the calling thread takes part as thread 0 (run() wakes n - 1 workers): the
// all-CPU engine. Without it every one of the n threads is a pool thread, so a job can run in the
// background (start(), then wait()) while the caller drives the GPU.
// Idle workers spin (briefly, or about a decode token for background pools, whose cores are their
// own) and then sleep on a futex, so an idle engine does not burn its cores.
class WorkerPool {
 public:
  WorkerPool(int n_threads, const int* cpus, bool caller_joins);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int size() const { return n_; }
  // Runs fn(tid, n, ctx) on every thread; returns when all of them have finished.
  void run(JobFn fn, void* ctx);
  // Starts fn on the pool threads and returns at once; only without caller_joins. ctx must live
  // until wait() returns.
  void start(JobFn fn, void* ctx);
  // start(), and once the job's last thread ends, *flag = value (a release store) before wait()
  // can return: a GPU that polls the flag through its mapping of pinned memory takes the result
  // then, with no host thread in between. With caller_joins the job runs here, then signals.
  void start_signaled(JobFn fn, void* ctx, uint64_t* flag, uint64_t value);
  // *flag = value (a release store): the signal of a job that had nothing to run.
  static void signal(uint64_t* flag, uint64_t value);
  // Returns when the job last started has finished on every pool thread.
  void wait();
  // Waits until every thread of the running job has reached this barrier.
  void barrier();
  // Seconds from the start of the last finished job to its last thread's end: its own time, also
  // when its caller wait()s for it late.
  double job_seconds() const;

 private:
  void worker_loop(int tid, int cpu);
  void wake(JobFn fn, void* ctx, uint64_t* end_flag = nullptr, uint64_t end_value = 0);
  void stamp_end();

  int n_;
  bool caller_joins_;
  uint64_t spin_cycles_;  // how long an idle worker spins before it sleeps
  std::vector<std::thread> threads_;
  JobFn fn_ = nullptr;
  void* ctx_ = nullptr;
  bool stop_ = false;
  uint64_t* end_flag_ = nullptr;  // the running job's end signal (start_signaled), else null
  uint64_t end_value_ = 0;
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<int> pending_{0};
  alignas(64) std::atomic<int> signal_pending_{0};  // threads yet to end before the end signal
  alignas(64) std::atomic<int> barrier_count_{0};
  alignas(64) std::atomic<uint32_t> barrier_phase_{0};
  std::atomic<int64_t> job_start_ns_{0};
  std::atomic<int64_t> job_end_ns_{0};
};

}  // namespace ftc

extern "C" {
void* ftc_pool_create(int n_threads, const int* cpus, int caller_joins);
void ftc_pool_wait(void* pool);
void ftc_pool_destroy(void* pool);
int ftc_pool_size(void* pool);
double ftc_pool_job_seconds(void* pool);
}
