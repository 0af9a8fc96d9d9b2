// One MoE layer's host work for one decode token, in one call: cache lookup, miss split, LRU
// victims, cache update, the CPU experts started in the background, and the lists that the GPU
// side needs (fills to copy, (slot, token, weight) pairs to compute). The same steps in numpy
// (`HostSplit.launch_general`) cost 0.3-0.6 ms per layer on the device; this is a few µs.
// Fixed code, shipped with the runtime and compiled together with each engine's kernels, whose
// ftc_expert_ffn_start it calls. It works on ExpertCache's own arrays, so that the general path
// (prompts, several tokens) and this one share one cache state; tests hold the two to the same
// results step by step.
#include <cstdint>
#include <cstring>

extern "C" int ftc_expert_ffn_start(void* pool, const uint8_t* experts, int64_t expert_stride, int n_tokens,
                                    const float* x, float* out, int n_experts, const int64_t* expert_ids,
                                    const int32_t* offsets, const int32_t* tok_idx, const float* tok_w,
                                    void* workspace);

namespace {

// The q slots with the smallest (last use, slot) key that `in_use` does not hold, in that order:
// empty slots (last use -1) first, then least recently used, lower slot first among equals.
// An O(n) scan keeping the q best in a small sorted array (q is at most top-k).
int choose_victims(const int64_t* last_used, int64_t n_slots, const int64_t* in_use, int n_in_use, int q,
                   int64_t* out) {
  int64_t keys[64];
  int n = 0;
  for (int64_t s = 0; s < n_slots; ++s) {
    const int64_t key = last_used[s] * n_slots + s;
    if (n == q && key >= keys[n - 1]) continue;
    bool used = false;
    for (int j = 0; j < n_in_use; ++j) used |= in_use[j] == s;
    if (used) continue;
    int j = n < q ? n++ : n - 1;
    for (; j > 0 && keys[j - 1] > key; --j) {
      keys[j] = keys[j - 1];
      out[j] = out[j - 1];
    }
    keys[j] = key;
    out[j] = s;
  }
  return n;
}

}  // namespace

extern "C" {

// Everything that stays fixed from token to token, set once by the runtime (`TokenPlanner`).
// All fields are 8 bytes wide, so the layout is the same on every ABI that ctypes mirrors.
struct TokenPlanArgs {
  void* pool;
  void* workspace;  // the CPU kernel's, for one token and k pairs; alive until ftc_pool_wait
  const uint8_t* experts;  // the FTW pool's first expert
  int64_t expert_stride;
  int64_t hidden;
  int64_t k;
  // The layer's input as OffloadedExperts.stage packs it, [x (hidden) | ids (k) | weights (k)]
  // in fp32; ids are indices within the layer, distinct.
  const float* staged;
  int64_t* slot_of;  // ExpertCache's arrays: FTW row → slot, slot → row, slot → last step used
  int64_t* id_of;
  int64_t* last_used;
  int64_t n_slots;
  const int32_t* fills_for_m;  // [k + 1]: the planner's q for m unique misses
  float* cpu_out;  // [hidden]: the CPU experts' weighted sum, complete after ftc_pool_wait
  int64_t* cpu_ids;  // [k], [k + 1], [k], [k]: the CPU job's arguments, alive until the wait
  int32_t* cpu_offsets;
  int32_t* cpu_tok;
  float* cpu_w;
  int32_t* pairs;  // [3][k]: slot, token row (0), weight bits per expert served from a slot
                   // (hits, then fills), then -1 slots
  int64_t* fills;  // [2][k]: FTW row, slot of each copy to make
  int32_t* counts;  // hits, fills, CPU experts
  int64_t* cpu_step;  // ExpertCache.cpu_step: FTW row → the step it was last computed on the CPU
  int64_t recent_steps;  // misses computed on the CPU this recently are filled first, all of them
  int64_t keep_fills;  // 0: a fill serves this call only, its slot stamped as an empty one's (MissPlanner.keeps_fills)
};

// One token's plan for the MoE layer whose first FTW row is base_id; `step` stamps the slots it
// reads. With allow_fills = 0 (static cache) every miss runs on the CPU. Returns the number of
// fills, or -1 when k is above 64.
int ftc_plan_token(const TokenPlanArgs* a, int64_t base_id, int64_t step, int allow_fills) {
  const int hidden = static_cast<int>(a->hidden), k = static_cast<int>(a->k);
  if (k > 64) return -1;
  const float* x = a->staged;
  const float* ids_f = a->staged + hidden;
  const float* w = a->staged + hidden + k;
  // The experts in ascending FTW row order (as the general path groups them), with their weights.
  int64_t ids[64];
  float wts[64];
  for (int j = 0; j < k; ++j) {
    int64_t id = base_id + static_cast<int64_t>(ids_f[j]);
    float wj = w[j];
    int i = j;
    for (; i > 0 && ids[i - 1] > id; --i) {
      ids[i] = ids[i - 1];
      wts[i] = wts[i - 1];
    }
    ids[i] = id;
    wts[i] = wj;
  }
  int64_t hit_slot[64], miss[64];
  float hit_w[64], miss_w[64];
  int n_hit = 0, n_miss = 0;
  for (int j = 0; j < k; ++j) {
    const int64_t s = a->slot_of[ids[j]];
    if (s >= 0) {
      hit_slot[n_hit] = s;
      hit_w[n_hit++] = wts[j];
    } else {
      miss[n_miss] = ids[j];
      miss_w[n_miss++] = wts[j];
    }
  }
  // Misses the CPU computed lately first (stable: ascending rows within each group), and at least
  // all of them fill (MissPlanner.fills_for): with locality they come back.
  int n_recent = 0;
  if (a->recent_steps > 0) {
    int64_t rest[64];
    float rest_w[64];
    int n_rest = 0;
    for (int j = 0; j < n_miss; ++j) {
      if (a->cpu_step[miss[j]] >= step - a->recent_steps) {
        miss[n_recent] = miss[j];
        miss_w[n_recent++] = miss_w[j];
      } else {
        rest[n_rest] = miss[j];
        rest_w[n_rest++] = miss_w[j];
      }
    }
    std::memcpy(miss + n_recent, rest, sizeof(int64_t) * n_rest);
    std::memcpy(miss_w + n_recent, rest_w, sizeof(float) * n_rest);
  }
  int64_t victims[64];
  const int q_split = a->fills_for_m[n_miss];
  const int q = allow_fills ? (q_split > n_recent ? q_split : n_recent) : 0;
  const int n_fill = q > 0 ? choose_victims(a->last_used, a->n_slots, hit_slot, n_hit, q, victims) : 0;
  // The CPU part first: its workers start while the caller queues the copies and the GPU work.
  const int n_cpu = n_miss - n_fill;
  std::memset(a->cpu_out, 0, sizeof(float) * hidden);
  a->cpu_offsets[0] = 0;
  for (int j = 0; j < n_cpu; ++j) {
    a->cpu_step[miss[n_fill + j]] = step;
    a->cpu_ids[j] = miss[n_fill + j];
    a->cpu_offsets[j + 1] = j + 1;
    a->cpu_tok[j] = 0;
    a->cpu_w[j] = miss_w[n_fill + j];
  }
  if (n_cpu > 0) {
    ftc_expert_ffn_start(a->pool, a->experts, a->expert_stride, 1, x, a->cpu_out, n_cpu, a->cpu_ids, a->cpu_offsets,
                         a->cpu_tok, a->cpu_w, a->workspace);
  }
  // Fills take their victims' slots; every slot this token reads becomes the most recently used.
  for (int j = 0; j < n_fill; ++j) {
    const int64_t old = a->id_of[victims[j]];
    if (old >= 0) a->slot_of[old] = -1;
    a->id_of[victims[j]] = miss[j];
    a->slot_of[miss[j]] = victims[j];
    a->fills[j] = miss[j];
    a->fills[k + j] = victims[j];
  }
  int32_t* pair_slot = a->pairs;
  int32_t* pair_tok = a->pairs + k;
  float* pair_w = reinterpret_cast<float*>(a->pairs + 2 * k);
  int p = 0;
  for (int j = 0; j < n_hit; ++j, ++p) {
    pair_slot[p] = static_cast<int32_t>(hit_slot[j]);
    pair_w[p] = hit_w[j];
  }
  for (int j = 0; j < n_fill; ++j, ++p) {
    pair_slot[p] = static_cast<int32_t>(victims[j]);
    pair_w[p] = miss_w[j];
  }
  // Without keep_fills a fill serves this token only, and a slot that did so stays the next victim
  // when a hit reads it: its last use stays -1, as an empty slot's.
  for (int j = 0; j < p; ++j) {
    const bool passing = !a->keep_fills && (j >= n_hit || a->last_used[pair_slot[j]] < 0);
    a->last_used[pair_slot[j]] = passing ? -1 : step;
    pair_tok[j] = 0;
  }
  for (; p < k; ++p) {
    pair_slot[p] = -1;
    pair_tok[p] = 0;
    pair_w[p] = 0.0f;
  }
  a->counts[0] = n_hit;
  a->counts[1] = n_fill;
  a->counts[2] = n_cpu;
  return n_fill;
}

}  // extern "C"
