// The CPU's share of a decode step that the GPU runs as data: a thread that waits on a doorbell in
// pinned host memory, which the GPU writes through its mapping once a layer's plan (the CPU job:
// experts grouped by expert, token rows, weights) and the layer's input are in place beside it;
// the thread runs the job on the engine's worker pool with the generated kernel, writes the result
// beside them and answers on a second flag, which the GPU waits on. No Python and no GIL on this
// path. Fixed code, shipped with the runtime and compiled together with each engine's kernels.
//
// Protocol: jobs carry increasing sequence numbers. The GPU (or a test standing in for it)
// writes the job, then stores its number into `ring` with release semantics at system scope; the
// thread acquires it, computes, and stores the same number into `done` with release semantics.
// A job with no CPU experts still answers, with a zero result.
#include <immintrin.h>
#include <time.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>

extern "C" int ftc_expert_ffn(void* pool, const uint8_t* experts, int64_t expert_stride, int n_tokens,
                              const float* x, float* out, int n_experts, const int64_t* expert_ids,
                              const int32_t* offsets, const int32_t* tok_idx, const float* tok_w, void* workspace);

extern "C" {

// Set once by the runtime (`CpuDoorbell`); every field is 8 bytes wide, as ctypes mirrors it.
struct DoorbellArgs {
  void* pool;  // a background worker pool (no caller thread): the doorbell thread only waits on it
  void* workspace;  // the kernel's, for max_tokens tokens and max_entries pairs
  const uint8_t* experts;  // the FTW pool's first expert
  int64_t expert_stride;
  int64_t hidden;
  int64_t max_tokens;
  int64_t max_entries;
  uint64_t* ring;  // the job the GPU has made ready
  uint64_t* done;  // the job this thread has finished (own cache line)
  const int64_t* n_tokens;  // [1] the job's token rows
  const int64_t* counts;  // [3] the plan's hits, fills and CPU experts
  const int64_t* cpu_ids;  // [max_entries] FTW rows, `counts[2]` of them
  const int64_t* cpu_offsets;  // [max_entries + 1]
  const int64_t* cpu_tok;  // [max_entries]
  const float* cpu_w;  // [max_entries]
  const float* x;  // [max_tokens, hidden]
  float* out;  // [max_tokens, hidden]
  int32_t* offsets32;  // [max_entries + 1], [max_entries]: the kernel's int32 lists, this thread's own
  int32_t* tok32;
  int64_t spin_ns;  // how long the thread spins for the next job before it naps between looks
  int64_t* status;  // [1] set to 1 when a job's sizes exceed the buffers (the job is then skipped)
};

}  // extern "C"

namespace {

int64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

struct Doorbell {
  DoorbellArgs a;
  std::atomic<bool> stop{false};
  std::thread thread;

  // Waits for job `seq`; false once stopped. Spins (a decode step's layers come every few
  // hundred µs); idle for longer than spin_ns it naps between looks, 50 µs at first and twice as
  // long each time up to 1 ms, so that an idle engine costs its core next to nothing.
  bool wait_for(uint64_t seq) {
    std::atomic_ref<uint64_t> ring(*a.ring);
    const int64_t idle_since = now_ns();
    long nap_ns = 50000;
    while (ring.load(std::memory_order_acquire) < seq) {
      if (stop.load(std::memory_order_relaxed)) return false;
      for (int i = 0; i < 64; ++i) _mm_pause();
      if (now_ns() - idle_since > a.spin_ns) {
        timespec nap{0, nap_ns};
        nanosleep(&nap, nullptr);
        nap_ns = nap_ns < 1000000 ? 2 * nap_ns : nap_ns;
      }
    }
    return true;
  }

  void run_job() {
    const int64_t n_tok = *a.n_tokens, n_cpu = a.counts[2];
    if (n_tok < 0 || n_tok > a.max_tokens || n_cpu > a.max_entries ||
        (n_cpu > 0 && (a.cpu_offsets[n_cpu] < 0 || a.cpu_offsets[n_cpu] > a.max_entries))) {
      *a.status = 1;
      return;
    }
    std::memset(a.out, 0, sizeof(float) * n_tok * a.hidden);
    if (n_cpu <= 0) return;
    const int64_t entries = a.cpu_offsets[n_cpu];
    for (int64_t j = 0; j <= n_cpu; ++j) a.offsets32[j] = static_cast<int32_t>(a.cpu_offsets[j]);
    for (int64_t p = 0; p < entries; ++p) a.tok32[p] = static_cast<int32_t>(a.cpu_tok[p]);
    ftc_expert_ffn(a.pool, a.experts, a.expert_stride, static_cast<int>(n_tok), a.x, a.out, static_cast<int>(n_cpu),
                   a.cpu_ids, a.offsets32, a.tok32, a.cpu_w, a.workspace);
  }

  void loop() {
    std::atomic_ref<uint64_t> done(*a.done);
    for (uint64_t seq = done.load(std::memory_order_relaxed) + 1; wait_for(seq); ++seq) {
      run_job();
      done.store(seq, std::memory_order_release);
    }
  }
};

}  // namespace

extern "C" {

// Starts the doorbell thread on `args` (copied); jobs are numbered from *args->done + 1.
void* ftc_doorbell_start(const DoorbellArgs* args) {
  auto* d = new Doorbell;
  d->a = *args;
  d->thread = std::thread([d] { d->loop(); });
  return d;
}

// Stops the thread (after the job it is computing, if any) and frees it.
void ftc_doorbell_stop(void* doorbell) {
  auto* d = static_cast<Doorbell*>(doorbell);
  d->stop.store(true, std::memory_order_relaxed);
  d->thread.join();
  delete d;
}

}  // extern "C"
