// Cycles per instruction of the AVX-512 operations the 4-bit expert kernels are made of, on the
// machine that runs it: latency (one dependent chain) and throughput (independent chains), in
// core cycles calibrated by a chain of dependent vpaddd (1 cycle each). The device VM has no
// hardware counters; this is how its port costs are known.
//   g++ -O2 -mavx512f -mavx512bw -mavx512bf16 -mavx512vnni -mavx512vbmi avx512_port_costs.cpp -o ports && ./ports
#include <chrono>
#include <cstdint>
#include <cstdio>

constexpr long N = 20'000'000;  // loop iterations; each runs 12 instructions of the kind measured
alignas(64) static uint8_t mem[256];

template <typename F>
double ns_per_iter(F f) {
  f(N / 10);  // warm up, clocks up
  const auto t0 = std::chrono::steady_clock::now();
  f(N);
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / N;
}

#define REP12(x) x x x x x x x x x x x x
#define LOOP(body, clobbers)                                                   \
  [](long n) {                                                                 \
    asm volatile("vpxord %%zmm0, %%zmm0, %%zmm0\n\t" REP_INIT                 \
                 "1:\n\t" body "dec %0\n\tjnz 1b" : "+r"(n) : "r"(mem) : clobbers); \
  }
#define REP_INIT                                                                               \
  "vpxord %%zmm1, %%zmm1, %%zmm1\n\tvpxord %%zmm2, %%zmm2, %%zmm2\n\tvpxord %%zmm3, %%zmm3, %%zmm3\n\t" \
  "vpxord %%zmm4, %%zmm4, %%zmm4\n\tvpxord %%zmm5, %%zmm5, %%zmm5\n\tvpxord %%zmm6, %%zmm6, %%zmm6\n\t" \
  "vpxord %%zmm7, %%zmm7, %%zmm7\n\tvpxord %%zmm8, %%zmm8, %%zmm8\n\tvpxord %%zmm9, %%zmm9, %%zmm9\n\t" \
  "vpxord %%zmm10, %%zmm10, %%zmm10\n\tvpxord %%zmm11, %%zmm11, %%zmm11\n\tvpxord %%zmm12, %%zmm12, %%zmm12\n\t" \
  "vpxord %%zmm13, %%zmm13, %%zmm13\n\tvpxord %%zmm14, %%zmm14, %%zmm14\n\t"
#define ZC "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9", "zmm10", "zmm11", "zmm12", "zmm13", "zmm14", "cc", "memory"

// 12 independent destinations zmm1..zmm12, sources zmm13/zmm14 (throughput), or one chain (latency).
#define T12(op) op " %%zmm13, %%zmm14, %%zmm1\n\t" op " %%zmm13, %%zmm14, %%zmm2\n\t" op " %%zmm13, %%zmm14, %%zmm3\n\t" \
  op " %%zmm13, %%zmm14, %%zmm4\n\t" op " %%zmm13, %%zmm14, %%zmm5\n\t" op " %%zmm13, %%zmm14, %%zmm6\n\t"            \
  op " %%zmm13, %%zmm14, %%zmm7\n\t" op " %%zmm13, %%zmm14, %%zmm8\n\t" op " %%zmm13, %%zmm14, %%zmm9\n\t"            \
  op " %%zmm13, %%zmm14, %%zmm10\n\t" op " %%zmm13, %%zmm14, %%zmm11\n\t" op " %%zmm13, %%zmm14, %%zmm12\n\t"
#define L12(op) REP12(op " %%zmm13, %%zmm1, %%zmm1\n\t")

int main() {
  struct Case { const char* name; double ns; };
  const double cyc = ns_per_iter(LOOP(L12("vpaddd"), ZC)) / 12;  // ns per core cycle
  const Case cases[] = {
      {"vdpbf16ps latency", ns_per_iter(LOOP(L12("vdpbf16ps"), ZC))},
      {"vdpbf16ps throughput", ns_per_iter(LOOP(T12("vdpbf16ps"), ZC))},
      {"vfmadd231ps latency", ns_per_iter(LOOP(L12("vfmadd231ps"), ZC))},
      {"vfmadd231ps throughput", ns_per_iter(LOOP(T12("vfmadd231ps"), ZC))},
      {"vpermw throughput", ns_per_iter(LOOP(T12("vpermw"), ZC))},
      {"vpermw latency (index chain)", ns_per_iter(LOOP(REP12("vpermw %%zmm13, %%zmm1, %%zmm1\n\t"), ZC))},
      {"vpermb throughput", ns_per_iter(LOOP(T12("vpermb"), ZC))},
      {"vpshufb throughput", ns_per_iter(LOOP(T12("vpshufb"), ZC))},
      {"vpdpbusd throughput", ns_per_iter(LOOP(T12("vpdpbusd"), ZC))},
      {"vpdpbusd latency", ns_per_iter(LOOP(L12("vpdpbusd"), ZC))},
      {"vpaddw throughput", ns_per_iter(LOOP(T12("vpaddw"), ZC))},
      {"vpsrlw throughput", ns_per_iter(LOOP(REP12("vpsrlw $4, %%zmm13, %%zmm1\n\t"), ZC))},
      {"vpmovzxbw from memory throughput", ns_per_iter(LOOP(REP12("vpmovzxbw (%1), %%zmm1\n\t"), ZC))},
      {"vpunpcklbw throughput", ns_per_iter(LOOP(T12("vpunpcklbw"), ZC))},
      {"vcvtdq2ps throughput", ns_per_iter(LOOP(REP12("vcvtdq2ps %%zmm13, %%zmm1\n\t"), ZC))},
  };
  std::printf("{\"ns_per_cycle\": %.4f, \"ghz\": %.3f", cyc, 1 / cyc);
  for (const Case& c : cases) std::printf(", \"%s\": %.3f", c.name, c.ns / 12 / cyc);
  std::printf("}\n");
}
