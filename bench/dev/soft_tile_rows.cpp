// The AVX-512 BF16 tile GEMM's inner loop alone (templates/cpu/expert_tiles.cpp.j2, `soft_gemm`),
// by weight rows per pass: 16 rows 4 KiB apart thrash an 8-way L1 (docs/history/performance-log.md,
// issue 24).
//   g++ -O3 -std=c++20 -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mfma bench/dev/soft_tile_rows.cpp -o /tmp/str
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <chrono>
#include <cstdio>
#include <vector>
struct TileRows { const uint16_t* rows; int64_t ld; float scale; };
constexpr int TB = 16;
inline __m512i bc(const uint16_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
template <int NA, int K, int RH>
__attribute__((noinline)) void soft_gemm(const TileRows* a, const uint16_t* b, float (*c)[TB][TB]) {
  for (int half = 0; half < TB; half += RH) {
    __m512 acc[NA][RH];
    for (int x = 0; x < NA; ++x) for (int r = 0; r < RH; ++r) acc[x][r] = _mm512_setzero_ps();
    for (int kp = 0; kp < K / 2; ++kp) {
      const __m512bh bv = (__m512bh)_mm512_loadu_si512(b + 32 * kp);
      for (int x = 0; x < NA; ++x) for (int r = 0; r < RH; ++r)
        acc[x][r] = _mm512_dpbf16_ps(acc[x][r], (__m512bh)bc(a[x].rows + (half + r) * a[x].ld + 2 * kp), bv);
    }
    for (int x = 0; x < NA; ++x) for (int r = 0; r < RH; ++r) _mm512_storeu_ps(c[x][half + r], acc[x][r]);
  }
}
template <int NA, int K, int RH> void run(const char* name) {
  std::vector<uint16_t> A(2 * 16 * K, 0x3f80), B(K * 16, 0x3f80);
  TileRows t[2] = {{A.data(), K, 1}, {A.data() + 16 * K, K, 1}};
  alignas(64) float c[2][16][16];
  int iters = 2000;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) soft_gemm<NA, K, RH>(t, B.data(), c);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double flops = 2.0 * NA * 16 * 16 * K * iters;
  printf("%s: %.1f GFLOP/s (c=%f)\n", name, flops / s / 1e9, c[0][0][0]);
}
int main() { run<2, 2048, 8>("gu rh8"); run<1, 768, 8>("down rh8"); run<1, 768, 16>("down rh16"); run<2, 2048, 4>("gu rh4"); run<1,2048,16>("na1 k2048 rh16");}
