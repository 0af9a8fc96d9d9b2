// The mxfp4 CPU expert kernel's dot in two weight layouts, for one token, on qwen3-30b-a3b shapes
// (gate/up 1536 x 2048, down 2048 x 768; an expert = both, codes + e8m0 scales, 2,506,752 bytes):
//   current:     each row's codes contiguous as FTW packs them, with the loop of
//                templates/cpu/expert_ffn_fp4_avx512.cpp.j2: a 64-byte load is 128 columns of one
//                row and an int32 lane 4 columns, so each load also takes 2 conversions, 2 vpermps
//                (the lanes' block scales) and 2 FMAs, and each row ends with a horizontal sum.
//   interleaved: 16 rows per group; a 32-column block of a group is 4 loads of 64 bytes, int32 lane
//                r of load q holding row r's columns 32b + 8q .. + 7 (byte i: column + i low, column
//                + 4 + i high). A lane's 4 activation columns are the same for all lanes (a
//                broadcast); the sums stay in int32 over the block, which ends with one conversion
//                and one FMA by the 16 rows' scales (16 bytes per group and block). No horizontal sum.
// Both take codes as 2v + 12 by vpermb and activations as per-32-column int8 parts (hi, lo) into
// vpdpbusd, as the engine does. Work items (the same bytes in either layout): gate rows 16i .. 16i + 15
// with the same up rows, as the engine pairs them, or 32 down rows. Both prefetch each cache line
// 4 rows' bytes ahead in the stream they read, and both decode e8m0 without the engine's e = 0 case
// (the scales here are 120..127).
// Correctness: expert 0 in both layouts against fp64 sum_k E2M1[code] 2^(e - 127) x_k (x the
// dequantized activations); error relative to max(|ref|, the rms output), PASS under 1e-5.
// Modes, in GB/s of weight bytes (codes + scales):
//   l1    one gate/up and one down item of one expert (47 KB) over and over: the instructions, 1 thread;
//   cold  each call 8 random experts of a pool (1000 by default, 2.5 GB), its items split over T threads;
//   hot   the same 8 experts every call.
// Build and run (about 15 s):
//   g++ -O3 -march=native -fopenmp -std=c++17 bench/dev/fp4_row_interleave.cpp -o /tmp/fp4_row_interleave
//   OMP_PROC_BIND=close /tmp/fp4_row_interleave [threads (default all)] [experts in the pool (default 1000)]
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

namespace {

constexpr int H = 2048, I = 768, B = 32;  // hidden, expert intermediate, weights per scale
constexpr int GU_ROWS = 2 * I;            // gate rows, then up rows
constexpr int64_t OFF_GU = 0;
constexpr int64_t OFF_DOWN = OFF_GU + int64_t{GU_ROWS} * H / 2;
constexpr int64_t OFF_GU_SC = OFF_DOWN + int64_t{H} * I / 2;
constexpr int64_t OFF_DOWN_SC = OFF_GU_SC + int64_t{GU_ROWS} * H / B;
constexpr int64_t EXPERT_BYTES = OFF_DOWN_SC + int64_t{H} * I / B;
static_assert(EXPERT_BYTES == 2506752, "qwen3-30b-a3b mxfp4 expert");
constexpr int GU_ITEMS = I / 16, DOWN_ITEMS = H / 32;                     // work items per expert
constexpr int64_t L1_BYTES = 32 * (H / 2 + H / B) + 32 * (I / 2 + I / B);  // one item of each kind
constexpr int PF_ROWS = 4;  // prefetch distance: 4 rows' bytes ahead in the stream being read
constexpr int TOP_K = 8;

const double E2M1[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};

// Unsigned 2v + 12 of each e2m1 code, repeated in each 16 bytes (vpermb reads an index's low 6 bits).
inline __m512i code_table() {
  return _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
}

// e8m0 scale bytes (1..254) as fp32 2^(e - 127): e in the exponent field.
inline __m512 e8m0(__m128i bytes) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu8_epi32(bytes), 23)); }
inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

// Activations in natural order: per 32 columns a scale s = amax / 127 and x / s ~ hi + lo / 256;
// sum: per block, the sum of 256 hi + lo; x: the dequantized values, for the reference.
struct Quant {
  std::vector<int8_t> hi, lo;
  std::vector<float> scale;
  std::vector<int32_t> sum;
  std::vector<double> x;
};

Quant quantize(const std::vector<float>& v) {
  const size_t K = v.size();
  Quant q{std::vector<int8_t>(K), std::vector<int8_t>(K), std::vector<float>(K / B), std::vector<int32_t>(K / B),
          std::vector<double>(K)};
  for (size_t b = 0; b < K / B; ++b) {
    float amax = 0;
    for (size_t k = B * b; k < B * b + B; ++k) amax = std::fmax(amax, std::fabs(v[k]));
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    q.scale[b] = amax / 127.0f;
    for (size_t k = B * b; k < B * b + B; ++k) {
      const float u = v[k] * inv, h = std::nearbyint(u);
      q.hi[k] = static_cast<int8_t>(h);
      q.lo[k] = static_cast<int8_t>(std::fmin(std::nearbyint((u - h) * 256.0f), 127.0f));
      q.sum[b] += 256 * q.hi[k] + q.lo[k];
      q.x[k] = static_cast<double>(q.scale[b]) * (q.hi[k] + q.lo[k] / 256.0);
    }
  }
  return q;
}

namespace current {
constexpr int GROUP = 16 * B;  // weights whose 16 scales are decoded at once

// Each 128-column chunk holds its 32-column blocks in the order 0, 2, 1, 3 (low nibbles, then high).
constexpr int slot_of(int b) { return b / 4 * 4 + (b % 4 == 1 ? 2 : b % 4 == 2 ? 1 : b % 4); }

template <int K>
struct Act {
  alignas(64) int8_t hi[K];
  alignas(64) int8_t lo[K];
  alignas(64) float scale[K / B + 16];
  alignas(64) float corr[K / B + 16];  // -12 * sum(256 hi + lo) / 2^8
  void fill(const Quant& q) {
    for (int b = 0; b < K / B; ++b) {
      std::memcpy(hi + B * slot_of(b), &q.hi[B * b], B);
      std::memcpy(lo + B * slot_of(b), &q.lo[B * b], B);
      scale[b] = q.scale[b];
      corr[b] = -12.0f * static_cast<float>(q.sum[b]) / 256.0f;
    }
    for (int b = K / B; b < K / B + 16; ++b) scale[b] = corr[b] = 0.0f;  // a group's loads past the end
  }
};

// 256 * (w . hi) + (w . lo) over four columns per int32 lane, exact.
inline __m512i dot_lanes(__m512i w, const int8_t* hi, const int8_t* lo) {
  const __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(hi));
  return _mm512_dpbusd_epi32(_mm512_slli_epi32(h, 8), w, _mm512_loadu_si512(lo));
}

// The weight block (within its group) of each int32 lane of chunk j's low (half 0) or high (half 1) nibbles.
inline __m512i lane_blocks(int j, int half) {
  const __m512i col = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 64, 68, 72, 76, 80, 84, 88, 92);
  return _mm512_srli_epi32(_mm512_add_epi32(col, _mm512_set1_epi32(128 * j + 32 * half)), 5);
}

struct Row { const uint8_t *codes, *scales; };

// *out[r] = rows[r] . x for R rows that share the activations (gate and up: R = 2).
template <int R, int K>
inline void dot_rows(const Row* rows, const Act<K>& a, float* const* out) {
  static_assert(K % 128 == 0, "whole 128-column chunks");
  constexpr int A = R >= 4 ? 1 : 4 / R;  // independent accumulators per row
  constexpr int PF_CODES = PF_ROWS * K / 2, PF_SCALES = PF_ROWS * K / B;
  const __m512i table = code_table();
  __m512 acc[R][A], offset[R];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < A; ++i) offset[r] = acc[r][i] = _mm512_setzero_ps();
  for (int g0 = 0; g0 < K; g0 += GROUP) {
    const int n = (K - g0 < GROUP ? K - g0 : GROUP) / B;
    __m512 sc[R];
    for (int r = 0; r < R; ++r) {
      prefetch(rows[r].scales + g0 / B + PF_SCALES);
      const __m128i e = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << n) - 1), rows[r].scales + g0 / B);
      sc[r] = _mm512_mul_ps(e8m0(e), _mm512_loadu_ps(a.scale + g0 / B));  // zero past n
      offset[r] = _mm512_fmadd_ps(sc[r], _mm512_loadu_ps(a.corr + g0 / B), offset[r]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < GROUP / 128; ++j) {
      const int k = g0 + 128 * j;
      if (k >= K) break;
      __m512i wlo[R], whi[R];
      for (int r = 0; r < R; ++r) {
        prefetch(rows[r].codes + k / 2 + PF_CODES);
        const __m512i v = _mm512_loadu_si512(rows[r].codes + k / 2);
        wlo[r] = _mm512_permutexvar_epi8(v, table);
        whi[r] = _mm512_permutexvar_epi8(_mm512_srli_epi16(v, 4), table);
      }
      for (int r = 0; r < R; ++r) {
        __m512& a0 = acc[r][(2 * j) % A];
        __m512& a1 = acc[r][(2 * j + 1) % A];
        const __m512 s0 = _mm512_permutexvar_ps(lane_blocks(j, 0), sc[r]);
        const __m512 s1 = _mm512_permutexvar_ps(lane_blocks(j, 1), sc[r]);
        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_lanes(wlo[r], a.hi + k, a.lo + k)), s0, a0);
        a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_lanes(whi[r], a.hi + k + 64, a.lo + k + 64)), s1, a1);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 sum = acc[r][0];
    for (int i = 1; i < A; ++i) sum = _mm512_add_ps(sum, acc[r][i]);
    const __m512 lanes = _mm512_fmadd_ps(sum, _mm512_set1_ps(1.0f / 256.0f), offset[r]);
    *out[r] = _mm512_reduce_add_ps(lanes) * 0.5f;  // 1/2 for the codes' 2v
  }
}

struct Layout {
  static constexpr const char* name = "current";
  static inline Act<H> x;  // gate/up activations
  static inline Act<I> a;  // down activations
  // Gate rows 16i .. 16i + 15, each with its up row, as the engine pairs them.
  static void gate_up(const uint8_t* e, int i, float* out) {
    for (int r = 16 * i; r < 16 * i + 16; ++r) {
      const Row rows[2] = {{e + OFF_GU + int64_t{r} * (H / 2), e + OFF_GU_SC + int64_t{r} * (H / B)},
                           {e + OFF_GU + int64_t{r + I} * (H / 2), e + OFF_GU_SC + int64_t{r + I} * (H / B)}};
      float* o[2] = {out + r, out + r + I};
      dot_rows<2, H>(rows, x, o);
    }
  }
  static void down(const uint8_t* e, int i, float* out) {
    for (int r = 32 * i; r < 32 * i + 32; ++r) {
      const Row row = {e + OFF_DOWN + int64_t{r} * (I / 2), e + OFF_DOWN_SC + int64_t{r} * (I / B)};
      float* o = out + r;
      dot_rows<1, I>(&row, a, &o);
    }
  }
};
}  // namespace current

namespace interleaved {
template <int K>
struct Act {
  alignas(64) int8_t hi[K];
  alignas(64) int8_t lo[K];
  float scale[K / B];
  int32_t corr[K / B];  // -12 * sum(256 hi + lo): the codes' +12, taken back in integers
  void fill(const Quant& q) {
    std::memcpy(hi, q.hi.data(), K);
    std::memcpy(lo, q.lo.data(), K);
    for (int b = 0; b < K / B; ++b) {
      scale[b] = q.scale[b];
      corr[b] = -12 * q.sum[b];
    }
  }
};

// Four activation bytes in every int32 lane.
inline __m512i bcast4(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }

// 16 rows: codes 16 x K/2 bytes (block after block, 256 bytes each), scales 16 bytes per block.
struct Group { const uint8_t *codes, *scales; };

// out[g][0..15] = the 16 rows of groups[g] . x.
template <int R, int K>
inline void dot_groups(const Group* groups, const Act<K>& a, float* const* out) {
  constexpr int PF_CODES = PF_ROWS * K / 2, PF_SCALES = PF_ROWS * K / B;
  const __m512i table = code_table();
  __m512 acc[R];
  for (int g = 0; g < R; ++g) acc[g] = _mm512_setzero_ps();
  for (int b = 0; b < K / B; ++b) {
    __m512i hi[R], lo[R];  // the block's w . hi and corr + w . lo of each row, exact
    for (int g = 0; g < R; ++g) {
      hi[g] = _mm512_setzero_si512();
      lo[g] = _mm512_set1_epi32(a.corr[b]);
    }
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const int c = B * b + 8 * q;
      const __m512i h0 = bcast4(a.hi + c), l0 = bcast4(a.lo + c), h1 = bcast4(a.hi + c + 4), l1 = bcast4(a.lo + c + 4);
      for (int g = 0; g < R; ++g) {
        const uint8_t* p = groups[g].codes + 256 * b + 64 * q;
        prefetch(p + PF_CODES);
        const __m512i v = _mm512_loadu_si512(p);
        const __m512i w0 = _mm512_permutexvar_epi8(v, table);                         // columns c .. c + 3
        const __m512i w1 = _mm512_permutexvar_epi8(_mm512_srli_epi16(v, 4), table);  // c + 4 .. c + 7
        hi[g] = _mm512_dpbusd_epi32(hi[g], w0, h0);
        lo[g] = _mm512_dpbusd_epi32(lo[g], w0, l0);
        hi[g] = _mm512_dpbusd_epi32(hi[g], w1, h1);
        lo[g] = _mm512_dpbusd_epi32(lo[g], w1, l1);
      }
    }
    for (int g = 0; g < R; ++g) {
      const uint8_t* s = groups[g].scales + 16 * b;
      if (b % 4 == 0) prefetch(s + PF_SCALES);
      const __m512 scale = _mm512_mul_ps(e8m0(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))),
                                         _mm512_set1_ps(a.scale[b]));
      const __m512i d = _mm512_add_epi32(_mm512_slli_epi32(hi[g], 8), lo[g]);  // |d| < 2^24: exact in fp32
      acc[g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[g]);
    }
  }
  for (int g = 0; g < R; ++g) _mm512_storeu_ps(out[g], _mm512_mul_ps(acc[g], _mm512_set1_ps(0.5f / 256.0f)));
}

// Group g (rows 16g .. 16g + 15) of the K-column matrix whose codes and scales start at e + off, e + off_sc.
template <int K>
inline Group group_of(const uint8_t* e, int64_t off, int64_t off_sc, int g) {
  return {e + off + int64_t{g} * 16 * (K / 2), e + off_sc + int64_t{g} * 16 * (K / B)};
}

struct Layout {
  static constexpr const char* name = "interleaved";
  static inline Act<H> x;
  static inline Act<I> a;
  // Gate rows 16i .. 16i + 15 (group i) and the same up rows (group I/16 + i).
  static void gate_up(const uint8_t* e, int i, float* out) {
    const Group g[2] = {group_of<H>(e, OFF_GU, OFF_GU_SC, i), group_of<H>(e, OFF_GU, OFF_GU_SC, I / 16 + i)};
    float* o[2] = {out + 16 * i, out + I + 16 * i};
    dot_groups<2, H>(g, x, o);
  }
  static void down(const uint8_t* e, int i, float* out) {
    const Group g[2] = {group_of<I>(e, OFF_DOWN, OFF_DOWN_SC, 2 * i), group_of<I>(e, OFF_DOWN, OFF_DOWN_SC, 2 * i + 1)};
    float* o[2] = {out + 32 * i, out + 32 * i + 16};
    dot_groups<2, I>(g, a, o);
  }
};
}  // namespace interleaved

// Where the code of column k of row n of a K-column matrix lies in each layout (byte, shift).
int64_t current_byte(int K, int n, int k) { return int64_t{n} * (K / 2) + k / 64 * 32 + k % 32; }
int current_shift(int k) { return k % 64 >= 32 ? 4 : 0; }
int64_t interleaved_byte(int K, int n, int k) {
  return int64_t{n / 16} * 16 * (K / 2) + k / B * 256 + k % B / 8 * 64 + n % 16 * 4 + k % 4;
}
int interleaved_shift(int k) { return k % 8 >= 4 ? 4 : 0; }

// The interleaved copy of a current-layout expert.
void repack(const uint8_t* src, uint8_t* dst) {
  std::memset(dst, 0, EXPERT_BYTES);
  const struct { int64_t off, off_sc; int rows, cols; } mats[2] = {{OFF_GU, OFF_GU_SC, GU_ROWS, H},
                                                                    {OFF_DOWN, OFF_DOWN_SC, H, I}};
  for (const auto& m : mats)
    for (int n = 0; n < m.rows; ++n)
      for (int k = 0; k < m.cols; ++k) {
        const int code = src[m.off + current_byte(m.cols, n, k)] >> current_shift(k) & 15;
        dst[m.off + interleaved_byte(m.cols, n, k)] |= static_cast<uint8_t>(code << interleaved_shift(k));
        if (k % B == 0)
          dst[m.off_sc + int64_t{n / 16} * 16 * (m.cols / B) + k / B * 16 + n % 16] =
              src[m.off_sc + int64_t{n} * (m.cols / B) + k / B];
      }
}

// fp64 sum_k E2M1[code] 2^(e - 127) x_k of every row, from the current layout.
std::vector<double> reference(const uint8_t* e, int64_t off, int64_t off_sc, int rows, int K, const Quant& q) {
  std::vector<double> out(rows);
  for (int n = 0; n < rows; ++n)
    for (int k = 0; k < K; ++k)
      out[n] += E2M1[e[off + current_byte(K, n, k)] >> current_shift(k) & 15] *
                std::ldexp(1.0, e[off_sc + int64_t{n} * (K / B) + k / B] - 127) * q.x[k];
  return out;
}

// Largest |out - ref| / max(|ref|, rms of ref): an fp32 sum's rounding scales with its terms, not with
// |ref|, which cancellation makes arbitrarily small (against |ref| alone, about 1% of these outputs
// would fail 1e-5 in either layout).
double max_rel_error(const float* out, const std::vector<double>& ref) {
  double rms = 0, worst = 0;
  for (const double r : ref) rms += r * r;
  rms = std::sqrt(rms / ref.size());
  for (size_t n = 0; n < ref.size(); ++n)
    worst = std::fmax(worst, std::fabs(out[n] - ref[n]) / std::fmax(std::fabs(ref[n]), rms));
  return worst;
}

alignas(64) float gu_out[TOP_K][GU_ROWS];
alignas(64) float down_out[TOP_K][H];

// One token's top-8 experts: the gate/up items of all of them, then (after the barrier) the down items.
template <class L>
void call(const uint8_t* const* experts) {
#pragma omp parallel
  {
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < TOP_K * GU_ITEMS; ++it)
      L::gate_up(experts[it / GU_ITEMS], it % GU_ITEMS, gu_out[it / GU_ITEMS]);
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < TOP_K * DOWN_ITEMS; ++it)
      L::down(experts[it / DOWN_ITEMS], it % DOWN_ITEMS, down_out[it / DOWN_ITEMS]);
  }
}

// All items of expert e (in L's layout) against the references.
template <class L>
bool check(const uint8_t* e, const std::vector<double>& ref_gu, const std::vector<double>& ref_down) {
  for (int i = 0; i < GU_ITEMS; ++i) L::gate_up(e, i, gu_out[0]);
  for (int i = 0; i < DOWN_ITEMS; ++i) L::down(e, i, down_out[0]);
  const double err = std::fmax(max_rel_error(gu_out[0], ref_gu), max_rel_error(down_out[0], ref_down));
  std::printf("%-11s correctness: max relative error %.2e: %s\n", L::name, err, err < 1e-5 ? "PASS" : "FAIL");
  return err < 1e-5;
}

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// GB/s of calls to f, each reading `bytes`, over about `seconds` (after 3 calls to warm up).
template <class F>
double gbps(double seconds, double bytes, F&& f) {
  for (int i = 0; i < 3; ++i) f();
  const auto t0 = std::chrono::steady_clock::now();
  int64_t n = 0;
  double t;
  for (; (t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()) < seconds; ++n) f();
  return n * bytes / t / 1e9;
}

enum Mode { L1, COLD, HOT };

template <class L>
void bench(Mode mode, const uint8_t* pool, int n_experts, int threads) {
  double r;
  if (mode == L1) {
    r = gbps(1.0, L1_BYTES, [&] {
      L::gate_up(pool, 0, gu_out[0]);
      L::down(pool, 0, down_out[0]);
    });
  } else {
    std::vector<int> ids(n_experts);
    std::iota(ids.begin(), ids.end(), 0);
    const uint8_t* experts[TOP_K];
    for (int j = 0; j < TOP_K; ++j) experts[j] = pool + j * EXPERT_BYTES;  // hot: experts 0..7
    uint64_t s = 7;
    r = gbps(2.0, double{TOP_K} * EXPERT_BYTES, [&] {
      for (int j = 0; mode == COLD && j < TOP_K; ++j) {  // cold: 8 distinct random experts (a partial shuffle)
        std::swap(ids[j], ids[j + splitmix(s) % (n_experts - j)]);
        experts[j] = pool + int64_t{ids[j]} * EXPERT_BYTES;
      }
      call<L>(experts);
    });
  }
  std::printf("%s %s T=%d: %.2f GB/s\n", L::name, mode == L1 ? "l1" : mode == COLD ? "cold" : "hot",
              mode == L1 ? 1 : threads, r);
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : omp_get_max_threads();
  const int n_experts = argc > 2 ? std::atoi(argv[2]) : 1000;
  if (threads < 1 || n_experts < TOP_K)
    return std::fprintf(stderr, "usage: %s [threads] [experts in the pool, >= %d]\n", argv[0], TOP_K), 2;
  omp_set_num_threads(threads);

  // The pool: random codes, scale bytes 120..127. Both layouts read it (random bytes either way).
  uint8_t* pool = static_cast<uint8_t*>(std::aligned_alloc(64, n_experts * EXPERT_BYTES));
#pragma omp parallel for schedule(static)
  for (int e = 0; e < n_experts; ++e) {
    uint8_t* p = pool + e * EXPERT_BYTES;
    uint64_t s = 1234567 + e;
    for (int64_t i = 0; i < EXPERT_BYTES; i += 8) reinterpret_cast<uint64_t*>(p)[i / 8] = splitmix(s);
    for (int64_t i = OFF_GU_SC; i < EXPERT_BYTES; ++i) p[i] = 120 + (p[i] & 7);
  }
  uint64_t seed = 42;
  std::vector<float> x(H), act(I);
  for (float& v : x) v = static_cast<float>(splitmix(seed) >> 11) * 0x1p-52f - 1.0f;
  for (float& v : act) v = static_cast<float>(splitmix(seed) >> 11) * 0x1p-52f - 1.0f;
  const Quant qx = quantize(x), qa = quantize(act);
  current::Layout::x.fill(qx);
  current::Layout::a.fill(qa);
  interleaved::Layout::x.fill(qx);
  interleaved::Layout::a.fill(qa);

  uint8_t* ilv = static_cast<uint8_t*>(std::aligned_alloc(64, EXPERT_BYTES));
  repack(pool, ilv);
  const std::vector<double> ref_gu = reference(pool, OFF_GU, OFF_GU_SC, GU_ROWS, H, qx);
  const std::vector<double> ref_down = reference(pool, OFF_DOWN, OFF_DOWN_SC, H, I, qa);
  const bool pass = check<current::Layout>(pool, ref_gu, ref_down) & check<interleaved::Layout>(ilv, ref_gu, ref_down);
  std::free(ilv);

  for (const Mode mode : {L1, COLD, HOT}) {
    bench<current::Layout>(mode, pool, n_experts, threads);
    bench<interleaved::Layout>(mode, pool, n_experts, threads);
  }
  std::free(pool);
  return pass ? 0 : 1;
}
