// C ABI, host entry points: argument checks, then the reference path of the same headers the kernels use.
// Builds with GCC or Clang in C++17 (no CUDA needed; GNU vector extensions in the greedy reader's argmax): this is
// what CI tests against echo_trtllm.core.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "checks.h"
#include "echo/budget.cuh"
#include "echo/gate.cuh"
#include "echo/pack.cuh"

using echo::index_t;
namespace abi = echo::abi;

namespace {

// the last segment whose key is <= key (the caller's keys start at <= every key it asks for)
inline int32_t segment_of(const double* keys, int32_t num_segments, double key) {
  return static_cast<int32_t>(std::upper_bound(keys, keys + num_segments, key) - keys) - 1;
}

inline double clamp01(double x) { return std::min(std::max(x, 0.0), 1.0); }

// one node's estimate off the compiled fit (echo_abi.h, echo_acceptance_estimate_host): c clamped, NaN -> NaN
inline double estimate_one(const echo_segments& f, double c, int32_t r) {
  if (std::isnan(c)) return c;
  c = clamp01(c);
  const int32_t s = segment_of(f.keys, f.num_segments, 2.0 * r + c);
  double prior = f.e0[s] + f.e1[s] * c;
  if (f.deep && f.deep[r]) {
    const double d = r + 1.0;
    const double x = std::pow(c, 1.0 / d);
    const int32_t t = segment_of(f.keys, f.num_segments, x);
    const double e = clamp01(f.l0[t] + f.l1[t] * (x - f.start[t]) + f.share[t] * x);
    prior = x > 0.0 ? c * std::pow(e / x, d) : std::pow(e, d);
  }
  return clamp01(f.l0[s] + f.l1[s] * (c - f.start[s]) + f.share[s] * prior);
}

// 16 lanes in GCC's vector extensions (the compiler's vectoriser does not take an argmax loop; they lower to the
// vector width the library is built for)
typedef float lanes_f __attribute__((vector_size(64)));
typedef int32_t lanes_i __attribute__((vector_size(64)));
constexpr int kLanes = 16;

#define ECHO_INLINE inline __attribute__((always_inline))

ECHO_INLINE float load_one(const float* p, int64_t i) { return p[i]; }
ECHO_INLINE float load_one(const uint16_t* p, int64_t i) {
  const uint32_t u = static_cast<uint32_t>(p[i]) << 16;  // bfloat16: the high half of a float32
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// (written through a reference: a 64-byte vector returned by value has another ABI with and without AVX-512)
ECHO_INLINE void load_lanes(const float* p, lanes_f& v) { std::memcpy(&v, p, sizeof v); }

// bfloat16: a float32's high half. __builtin_convertvector (GCC 9+, Clang) widens the 16 halves in one vector
// instruction; older compilers get the loop, the same values, slower
#if defined(__clang__) || __GNUC__ >= 9
typedef uint32_t lanes_u __attribute__((vector_size(64)));
typedef uint16_t lanes_h __attribute__((vector_size(32)));
ECHO_INLINE void load_lanes(const uint16_t* p, lanes_f& v) {
  lanes_h h;
  std::memcpy(&h, p, sizeof h);
  const lanes_u u = __builtin_convertvector(h, lanes_u) << 16;
  std::memcpy(&v, &u, sizeof v);
}
#else
ECHO_INLINE void load_lanes(const uint16_t* p, lanes_f& v) {
  uint16_t h[kLanes];
  uint32_t u[kLanes];
  std::memcpy(h, p, sizeof h);
  for (int j = 0; j < kLanes; ++j) u[j] = static_cast<uint32_t>(h[j]) << 16;
  std::memcpy(&v, u, sizeof v);
}
#endif

// The first index of the row's maximum, or of its first NaN where it has one: torch.argmax's answer (values are
// only compared, never computed). One pass keeps, per lane, its largest value and where it first met it, and
// whether it met a NaN; the answer is the smallest index among the lanes holding the maximum. Inlined into one
// clone per instruction set below (the library is built for any x86-64; the loader picks the CPU's clone).
template <typename T>
ECHO_INLINE int64_t argmax_lanes(const T* __restrict x, int64_t n) {
  lanes_f best = lanes_f{} - INFINITY;
  lanes_i where = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  lanes_i idx = where, nan = lanes_i{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    lanes_f f;
    load_lanes(x + i, f);
    const lanes_i more = f > best;
    best = more ? f : best;
    where = more ? idx : where;
    nan |= f != f;
    idx += kLanes;
  }
  float top = -INFINITY;
  int64_t at = n;  // past the end: nothing met yet
  bool any_nan = false;
  for (int j = 0; j < kLanes; ++j) {
    any_nan |= nan[j] != 0;
    if (i > 0 && (best[j] > top || (best[j] == top && where[j] < at))) top = best[j], at = where[j];
  }
  for (; i < n; ++i) {
    const float f = load_one(x, i);
    any_nan |= f != f;
    if (f > top || at == n) top = f, at = i;
  }
  if (any_nan)
    for (i = 0; i < n; ++i) {
      const float f = load_one(x, i);
      if (f != f) return i;
    }
  return at == n ? 0 : at;
}

// clones need the loader's ifunc (glibc on Linux) and GCC's target_clones; elsewhere one build for the target
#if defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__CUDACC__)
#define ECHO_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define ECHO_CLONES
#endif

ECHO_CLONES int64_t argmax_row(const float* x, int64_t n) { return argmax_lanes(x, n); }
ECHO_CLONES int64_t argmax_row(const uint16_t* x, int64_t n) { return argmax_lanes(x, n); }

// Greedy acceptance's walk (echo_abi.h, echo_accept_greedy_host), the target's top-1 after node j read as pred(j):
// only for nodes on an accepted path, in node order, and for each request's last accepted node
template <typename Pred>
int accept_greedy(const char* who, const int64_t* input_ids, const int32_t* parents, const int32_t* depths,
                  const int32_t* cu, int32_t batch_size, int32_t num_nodes, int32_t width, int64_t* nodes,
                  int64_t* tokens, int64_t* counts, Pred pred) {
  ECHO_REQUIRE(batch_size >= 1 && num_nodes >= batch_size && width >= 1,
               "%s: batch_size must be >= 1, num_nodes >= batch_size (a root each) and width >= 1, got %d, %d, %d",
               who, batch_size, num_nodes, width);
  ECHO_REQUIRE(input_ids && parents && depths && cu && nodes && tokens && counts, "%s: a required array is NULL",
               who);
  ECHO_REQUIRE(cu[0] == 0 && cu[batch_size] == num_nodes, "%s: cu must run from 0 to num_nodes (%d), got %d to %d",
               who, num_nodes, cu[0], cu[batch_size]);
  for (int32_t r = 0; r < batch_size; ++r)  // every request's range inside [0, num_nodes) before any node is read
    ECHO_REQUIRE(cu[r + 1] > cu[r] && cu[r + 1] <= num_nodes, "%s: request %d has no nodes or runs past num_nodes "
                 "(cu[%d] = %d, cu[%d] = %d): cu must rise strictly to num_nodes (%d), a root each", who, r, r, cu[r],
                 r + 1, cu[r + 1], num_nodes);
  for (int32_t r = 0; r < batch_size; ++r)  // the whole tree checked before any row is read
    for (int32_t j = cu[r]; j < cu[r + 1]; ++j) {
      const int32_t p = parents[j], d = depths[j];
      ECHO_REQUIRE((j == cu[r]) == (p < 0), "%s: node %d: a request's first node is its root (parent -1) and no "
                   "other is, got parent %d", who, j, p);
      ECHO_REQUIRE(p < j - cu[r], "%s: node %d: its parent %d must come before it in its request", who, j, p);
      ECHO_REQUIRE(d == (p < 0 ? 0 : depths[cu[r] + p] + 1) && d < width, "%s: node %d: depth %d must be its "
                   "parent's + 1 (a root's 0) and below width %d", who, j, d, width);
    }
  std::vector<uint8_t> ok(static_cast<size_t>(num_nodes), 0);
  for (int32_t r = 0; r < batch_size; ++r) {
    const int32_t start = cu[r], end = cu[r + 1];
    int32_t last = start;
    for (int32_t j = start; j < end; ++j) {
      const int32_t p = parents[j];
      // on an accepted path iff its draft is the target's choice after its parent, and the parent is on one
      ok[j] = p < 0 || (ok[start + p] && input_ids[j] == pred(start + p));
      if (ok[j] && depths[j] > depths[last]) last = j;  // the deepest; at equal depth the lowest index stays
    }
    const int32_t n = depths[last];
    const int64_t bonus = pred(last);
    int64_t* row_nodes = nodes + static_cast<size_t>(r) * width;
    int64_t* row_tokens = tokens + static_cast<size_t>(r) * width;
    for (int32_t c = 0; c < width; ++c) {
      row_nodes[c] = -1;
      row_tokens[c] = bonus;  // the bonus: the path's last column and every one after it
    }
    for (int32_t j = last, c = n; c >= 0; j = start + parents[j], --c) {  // up to the root (its -1 parent never indexed)
      row_nodes[c] = j;
      if (c > 0) row_tokens[c - 1] = input_ids[j];
    }
    counts[r] = n + 1;
  }
  return abi::ok();
}

int check_segments(const echo_segments& f, const char* who) {
  ECHO_REQUIRE(f.num_segments >= 1 && f.num_rows >= 1, "%s: num_segments and num_rows must be >= 1, got %d and %d",
               who, f.num_segments, f.num_rows);
  ECHO_REQUIRE(f.keys && f.start && f.l0 && f.l1 && f.share && f.e0 && f.e1,
               "%s: a required segment array is NULL (keys, start, l0, l1, share, e0, e1)", who);
  ECHO_REQUIRE(f.keys[0] <= 0.0, "%s: the first segment must start at key 0 (row 0, confidence 0), got %g", who,
               f.keys[0]);
  for (int32_t s = 1; s < f.num_segments; ++s)
    ECHO_REQUIRE(f.keys[s - 1] <= f.keys[s], "%s: keys must be ascending, keys[%d] = %g > keys[%d] = %g", who, s - 1,
                 f.keys[s - 1], s, f.keys[s]);
  return abi::ok();
}

}  // namespace

extern "C" {

int echo_abi_version(void) { return ECHO_ABI_VERSION; }

#ifndef ECHO_WITH_CUDA  // the CUDA library defines it (echo_cuda.cu)
int echo_has_cuda(void) { return 0; }
#endif

const char* echo_last_error(void) { return abi::last_error().c_str(); }

int echo_gate_host(const float* path_probs, const int32_t* request_ids, const uint8_t* active,
                   int32_t num_level_nodes, int32_t batch_size, float tau, float* confidence, uint8_t* passed) {
  if (int rc = abi::check_gate_scalars(path_probs, request_ids, active, num_level_nodes, batch_size, tau, confidence,
                                       passed))
    return rc;
  if (batch_size == 0) return abi::ok();
  if (int rc = abi::check_gate_data(path_probs, request_ids, num_level_nodes, batch_size)) return rc;
  echo::host::gate({path_probs, request_ids, active, num_level_nodes, batch_size, tau, confidence, passed});
  return abi::ok();
}

int echo_allocate_budget_host(const float* path_probs, const int32_t* depths, const int32_t* parents,
                              const int32_t* cu, int32_t batch_size, int32_t num_nodes, const int32_t* spine_depth,
                              int32_t budget, int32_t max_nodes_per_request, uint8_t* selected, int8_t* phase,
                              int32_t* num_nodes_out, int32_t* order, int32_t* order_len) {
  if (int rc = abi::check_tree_scalars("allocate_budget", batch_size, num_nodes)) return rc;
  if (batch_size == 0) {
    if (int rc = abi::check_empty_allocation(order_len)) return rc;
    *order_len = 0;
    return abi::ok();
  }
  ECHO_REQUIRE(path_probs && depths && parents && cu && spine_depth && selected && phase && num_nodes_out && order_len,
               "allocate_budget: a required array is NULL");
  ECHO_REQUIRE(budget >= batch_size,
               "allocate_budget: budget K_max = %d is below the batch size %d: every request needs its root", budget,
               batch_size);
  if (int rc = abi::check_tree_data("allocate_budget", cu, parents, depths, batch_size, num_nodes)) return rc;
  for (int32_t i = 0; i < num_nodes; ++i)
    ECHO_REQUIRE(path_probs[i] >= 0.0f && path_probs[i] <= 1.0f,
                 "allocate_budget: path_probs[%d] = %g is not a probability in [0, 1]", i, path_probs[i]);
  for (int32_t r = 0; r < batch_size; ++r)
    ECHO_REQUIRE(spine_depth[r] >= 0, "allocate_budget: spine_depth[%d] = %d must be >= 0", r, spine_depth[r]);
  std::vector<int32_t> scratch_order;  // the multi-pass path writes the order even when the caller wants none
  if (!order && num_nodes > echo::kFusedMaxNodes) {
    scratch_order.resize(num_nodes);
    order = scratch_order.data();
  }
  echo::AllocationArgs a{{path_probs, depths, parents, cu, batch_size, num_nodes},
                         spine_depth,
                         budget,
                         max_nodes_per_request,
                         {selected, phase, num_nodes_out, order, order_len}};
  if (order)
    echo::host::allocate_budget(a);
  else
    echo::host::allocate_budget_fused(a);
  return abi::ok();
}

int echo_select_host(const float* path_probs, const int32_t* depths, const int32_t* parents, const int32_t* cu,
                     int32_t batch_size, int32_t num_nodes, const int32_t* spine_depth, int32_t budget,
                     int32_t max_nodes_per_request, uint8_t* selected, int8_t* phase, int32_t* num_nodes_out,
                     int32_t* order, int32_t* order_len, const uint8_t* greedy, const echo_segments* fit,
                     int32_t max_depth, const double* seconds, int32_t num_seconds, int32_t min_taken) {
  const char* who = "select";
  ECHO_REQUIRE(order && greedy && fit && seconds, "%s: a required array is NULL (order, greedy, fit, seconds)", who);
  ECHO_REQUIRE(max_depth >= 1 && 2 * max_depth <= fit->num_rows,
               "%s: max_depth must be >= 1 with 2 * max_depth <= the fit's rows (%d), got %d", who, fit->num_rows,
               max_depth);
  const int32_t most = std::min(num_nodes, budget) - batch_size;  // the most nodes the allocation takes
  ECHO_REQUIRE(num_seconds >= most + 1,
               "%s: seconds must hold one entry per taken count 0 .. min(num_nodes, budget) - batch_size = %d, got %d",
               who, most, num_seconds);
  ECHO_REQUIRE(min_taken >= 0, "%s: min_taken must be >= 0 (0: the budget rule alone), got %d", who, min_taken);
  if (int rc = check_segments(*fit, who)) return rc;
  if (int rc = echo_allocate_budget_host(path_probs, depths, parents, cu, batch_size, num_nodes, spine_depth, budget,
                                         max_nodes_per_request, selected, phase, num_nodes_out, order, order_len))
    return rc;
  const int32_t taken = *order_len;
  if (taken == 0) return abi::ok();
  // the expected tokens per second of verifying the roots and the first n taken nodes; the first maximum
  double gain = 0.0;
  int32_t best = 0;
  double best_rate = batch_size / seconds[0];
  for (int32_t n = 1; n <= taken; ++n) {
    const int32_t i = order[n - 1];
    const int32_t d = std::min(std::max(depths[i], 1), max_depth) - 1;
    gain += estimate_one(*fit, static_cast<double>(path_probs[i]), d + (greedy[i] ? 0 : max_depth));
    const double rate = (batch_size + gain) / seconds[n];
    if (rate > best_rate) {
      best_rate = rate;
      best = n;
    }
  }
  // a probe's floor where the rule keeps none (EchoPolicy.select: k = max(k, min_tokens) when k <= B)
  if (best == 0) best = std::min(min_taken, taken);
  // keep the first `best` taken nodes: the others leave the selection
  for (int32_t n = best; n < taken; ++n) {
    const int32_t i = order[n];
    selected[i] = 0;
    phase[i] = -1;
    const int32_t r = static_cast<int32_t>(std::upper_bound(cu, cu + batch_size + 1, i) - cu) - 1;
    num_nodes_out[r] -= 1;
  }
  *order_len = best;
  return abi::ok();
}

int echo_pack_host(const int32_t* parents, const int32_t* cu, const uint8_t* selected, const int32_t* context_lengths,
                   int32_t batch_size, int32_t num_nodes, int32_t num_selected, int32_t n_max, int32_t* cu_out,
                   int32_t* generation_lengths, int32_t* src_index, int32_t* parents_out, int32_t* depths_out,
                   int32_t* position_ids, int32_t* position_offsets, int32_t* packed_mask) {
  if (int rc = abi::check_tree_scalars("pack", batch_size, num_nodes)) return rc;
  if (batch_size == 0) {
    if (int rc = abi::check_empty_pack(cu_out, num_selected)) return rc;
    cu_out[0] = 0;
    return abi::ok();
  }
  ECHO_REQUIRE(parents && cu && cu_out && generation_lengths && src_index && parents_out && depths_out &&
                   position_ids && position_offsets && packed_mask,
               "pack: a required array is NULL");
  ECHO_REQUIRE(n_max >= 1, "pack: n_max must be >= 1, got %d", n_max);
  if (int rc = abi::check_tree_data("pack", cu, parents, nullptr, batch_size, num_nodes)) return rc;
  int32_t count = 0;
  for (int32_t r = 0; r < batch_size; ++r) {
    int32_t k = 0;
    for (int32_t i = cu[r]; i < cu[r + 1]; ++i) {
      const bool sel = !selected || selected[i];
      const int32_t p = parents[i];
      if (i == cu[r]) ECHO_REQUIRE(sel, "pack: request %d's root (node %d) must be selected", r, i);
      if (sel && p >= 0)
        ECHO_REQUIRE(!selected || selected[cu[r] + p],
                     "pack: selection is not ancestor-closed: node %d is selected but its parent is not", i);
      k += sel;
    }
    ECHO_REQUIRE(k <= n_max, "pack: request %d keeps %d nodes but n_max is %d; n_max must be >= every K_i", r, k,
                 n_max);
    count += k;
  }
  ECHO_REQUIRE(count == num_selected, "pack: num_selected is %d but the selection keeps %d nodes", num_selected, count);
  std::vector<index_t> new_index(num_nodes);
  echo::PackArgs a{parents,      cu,          selected,    context_lengths, batch_size,   num_nodes,
                   num_selected, n_max,       new_index.data(), cu_out,     generation_lengths, src_index,
                   parents_out,  depths_out,  position_ids, position_offsets, packed_mask};
  echo::host::pack(a);
  return abi::ok();
}

int echo_acceptance_estimate_host(const double* confidences, const int32_t* rows, int32_t num_nodes,
                                  const double* keys, const double* start, const double* l0, const double* l1,
                                  const double* share, const double* e0, const double* e1, int32_t num_segments,
                                  const uint8_t* deep, int32_t num_rows, double* out) {
  ECHO_REQUIRE(num_nodes >= 0, "acceptance_estimate: num_nodes must be >= 0, got %d", num_nodes);
  ECHO_REQUIRE(num_nodes == 0 || (confidences && rows && out),
               "acceptance_estimate: a required array is NULL (confidences, rows, out)");
  const echo_segments fit{keys, start, l0, l1, share, e0, e1, num_segments, deep, num_rows};
  if (int rc = check_segments(fit, "acceptance_estimate")) return rc;
  for (int32_t i = 0; i < num_nodes; ++i) {
    ECHO_REQUIRE(rows[i] >= 0 && rows[i] < num_rows, "acceptance_estimate: rows[%d] = %d is outside [0, %d)", i,
                 rows[i], num_rows);
  }
  for (int32_t i = 0; i < num_nodes; ++i) out[i] = estimate_one(fit, confidences[i], rows[i]);
  return abi::ok();
}

namespace {

// echo_replay_level_host's body (who: the entry point named in errors)
int replay_level(const char* who, const int64_t* prev_request_ids, const float* prev_path_probs,
                 const int64_t* prev_slots, int32_t num_prev, int32_t slot_width, const int64_t* front,
                 const uint8_t* fvalid, const float* probs, const int64_t* tokens, int32_t num_rows, int32_t width,
                 int32_t children, const int64_t* row_of, int32_t batch_size, int32_t depth, int32_t max_levels,
                 int32_t has_tau, float tau, int32_t budget_stop, int32_t budget_spare, const echo_segments* fit,
                 int32_t gain_row, const uint8_t* active_in, uint8_t* active_out, int64_t* spine_depth,
                 int64_t* failed_at, float* history, int64_t* out_slot_of, int64_t* out_request_ids,
                 int64_t* out_parent_ids, int64_t* out_token_ids, float* out_draft_probs, float* out_path_probs,
                 int64_t* out_ranks, int64_t* out_slots, int32_t* num_frontier, int32_t* num_active, int64_t* claimed,
                 double* gain) {
  ECHO_REQUIRE(batch_size >= 1 && num_prev >= 0 && num_rows >= 0 && width >= 1 && children >= 1 && slot_width >= 1,
               "%s: batch_size, width, children and slot_width must be >= 1 and num_prev, num_rows >= 0, got %d, %d, "
               "%d, %d, %d, %d", who, batch_size, width, children, slot_width, num_prev, num_rows);
  ECHO_REQUIRE(depth >= 1 && depth <= max_levels, "%s: depth must be in [1, max_levels = %d], got %d", who,
               max_levels, depth);
  ECHO_REQUIRE(budget_spare >= 0, "%s: budget_spare must be >= 0, got %d", who, budget_spare);
  ECHO_REQUIRE(row_of && active_in && active_out && spine_depth && failed_at && history && num_frontier &&
                   num_active && claimed && gain,
               "%s: a required array is NULL (row_of, active_in, active_out, spine_depth, failed_at, history, "
               "num_frontier, num_active, claimed, gain)", who);
  ECHO_REQUIRE(num_prev == 0 || (prev_request_ids && prev_path_probs && prev_slots && out_slot_of && out_request_ids &&
                                 out_parent_ids && out_token_ids && out_draft_probs && out_path_probs && out_ranks &&
                                 out_slots),
               "%s: a required level array is NULL", who);
  ECHO_REQUIRE(num_rows == 0 || (front && fvalid && probs && tokens),
               "%s: a required device array is NULL (front, fvalid, probs, tokens)", who);
  if (fit) {
    if (int rc = check_segments(*fit, who)) return rc;
    ECHO_REQUIRE(gain_row >= 0 && gain_row < fit->num_rows, "%s: gain_row = %d is outside [0, %d)", who, gain_row,
                 fit->num_rows);
  }
  for (int32_t b = 0; b < batch_size; ++b)
    ECHO_REQUIRE(row_of[b] >= 0 && row_of[b] <= num_rows, "%s: row_of[%d] = %lld is outside [0, num_rows = %d]", who,
                 b, static_cast<long long>(row_of[b]), num_rows);
  for (int64_t i = 0; i < static_cast<int64_t>(num_rows) * width; ++i)
    ECHO_REQUIRE(front[i] >= 0 && front[i] < slot_width, "%s: front[%lld] = %lld is outside [0, slot_width = %d)", who,
                 static_cast<long long>(i), static_cast<long long>(front[i]), slot_width);
  for (int32_t i = 0; i < num_prev; ++i) {
    ECHO_REQUIRE(prev_request_ids[i] >= 0 && prev_request_ids[i] < batch_size,
                 "%s: prev_request_ids[%d] = %lld is outside [0, %d)", who, i,
                 static_cast<long long>(prev_request_ids[i]), batch_size);
    ECHO_REQUIRE(prev_slots[i] >= 0 && prev_slots[i] < slot_width, "%s: prev_slots[%d] = %lld is outside [0, %d)",
                 who, i, static_cast<long long>(prev_slots[i]), slot_width);
  }

  // the frontier slot of each previous node in its row's device frontier (-1: none); the padding row stays -1
  std::vector<int64_t> table(static_cast<size_t>(num_rows + 1) * slot_width, -1);
  for (int32_t r = 0; r < num_rows; ++r)
    for (int32_t j = 0; j < width; ++j)
      table[static_cast<size_t>(r) * slot_width + front[static_cast<size_t>(r) * width + j]] =
          fvalid[static_cast<size_t>(r) * width + j] ? j : -1;
  int32_t f = 0;
  for (int32_t i = 0; i < num_prev; ++i) {
    const int64_t req = prev_request_ids[i];
    const int64_t r = row_of[req];
    const int64_t w = active_in[req] ? table[static_cast<size_t>(r) * slot_width + prev_slots[i]] : -1;
    out_slot_of[i] = w;
    if (w < 0) continue;
    const size_t src = (static_cast<size_t>(r) * width + w) * children;
    for (int32_t j = 0; j < children; ++j) {
      const size_t o = static_cast<size_t>(f) * children + j;
      const float p = probs[src + j];
      out_request_ids[o] = req;
      out_parent_ids[o] = i;
      out_token_ids[o] = tokens[src + j];
      out_draft_probs[o] = p;
      out_path_probs[o] = prev_path_probs[i] * p;
      out_ranks[o] = j;
      out_slots[o] = w * children + j;
    }
    ++f;
  }
  *num_frontier = f;
  *num_active = 0;
  *claimed = 0;
  *gain = 0.0;
  if (f == 0) return abi::ok();

  // the level's confidence per request, then the gate, the spine and the budget stop (EchoPolicy.observe)
  float* c = history + static_cast<size_t>(depth - 1) * batch_size;
  std::fill(c, c + batch_size, 0.0f);
  for (int64_t o = 0; o < static_cast<int64_t>(f) * children; ++o) {
    const int64_t req = out_request_ids[o];
    c[req] = std::max(c[req], out_path_probs[o]);
  }
  int32_t n = 0;
  for (int32_t b = 0; b < batch_size; ++b) {
    bool a = active_in[b] != 0;
    if (has_tau && a && !(c[b] > tau)) {
      failed_at[b] = depth;
      a = false;
    }
    if (a) spine_depth[b] = depth;
    active_out[b] = a;
    n += a;
  }
  if (budget_stop && n > 0 && static_cast<int64_t>(depth) * n > budget_spare) {
    float bar = std::numeric_limits<float>::infinity();
    if (budget_spare > 0) {
      std::vector<float> seen;
      seen.reserve(static_cast<size_t>(depth) * n);
      for (int32_t d = 0; d < depth; ++d)
        for (int32_t b = 0; b < batch_size; ++b)
          if (active_out[b]) seen.push_back(history[static_cast<size_t>(d) * batch_size + b]);
      std::nth_element(seen.begin(), seen.begin() + (budget_spare - 1), seen.end(), std::greater<float>());
      bar = seen[budget_spare - 1];
    }
    n = 0;
    for (int32_t b = 0; b < batch_size; ++b) {
      active_out[b] = active_out[b] && c[b] >= bar;
      n += active_out[b];
    }
  }
  int64_t spine = 0;
  for (int32_t b = 0; b < batch_size; ++b) spine += spine_depth[b];
  *num_active = n;
  *claimed = batch_size + spine;
  if (fit && n > 0) {
    double g = 0.0;
    for (int32_t b = 0; b < batch_size; ++b)
      if (active_out[b]) g += estimate_one(*fit, static_cast<double>(c[b]), gain_row);
    *gain = g;
  }
  return abi::ok();
}

// A device level's slot s of row r as the device scores it: its parent's path probability x its own draft
// probability, -1 for padding (core.policies._level_on_device's score)
inline float device_score(const float* parent_path, const uint8_t* fvalid, const float* probs, int32_t width,
                          int32_t children, size_t r, int64_t s) {
  const size_t j = static_cast<size_t>(r) * width + static_cast<size_t>(s / children);
  return fvalid[j] ? parent_path[j] * probs[static_cast<size_t>(r) * width * children + s] : -1.0f;
}

// torch.sort(descending=True, stable=True)'s order on one row's scores: NaN first, then larger, ties by slot
inline bool scored_before(const float* score, int32_t a, int32_t b) {
  const float x = score[a], y = score[b];
  const bool nx = x != x, ny = y != y;
  if (nx != ny) return nx;
  if (!nx && x != y) return x > y;
  return a < b;
}

}  // namespace

int echo_replay_level_host(const int64_t* prev_request_ids, const float* prev_path_probs, const int64_t* prev_slots,
                           int32_t num_prev, int32_t slot_width, const int64_t* front, const uint8_t* fvalid,
                           const float* probs, const int64_t* tokens, int32_t num_rows, int32_t width,
                           int32_t children, const int64_t* row_of, int32_t batch_size, int32_t depth,
                           int32_t max_levels, int32_t has_tau, float tau, int32_t budget_stop, int32_t budget_spare,
                           const echo_segments* fit, int32_t gain_row, const uint8_t* active_in, uint8_t* active_out,
                           int64_t* spine_depth, int64_t* failed_at, float* history, int64_t* out_slot_of,
                           int64_t* out_request_ids, int64_t* out_parent_ids, int64_t* out_token_ids,
                           float* out_draft_probs, float* out_path_probs, int64_t* out_ranks, int64_t* out_slots,
                           int32_t* num_frontier, int32_t* num_active, int64_t* claimed, double* gain) {
  return replay_level("replay_level", prev_request_ids, prev_path_probs, prev_slots, num_prev, slot_width, front,
                      fvalid, probs, tokens, num_rows, width, children, row_of, batch_size, depth, max_levels,
                      has_tau, tau, budget_stop, budget_spare, fit, gain_row, active_in, active_out, spine_depth,
                      failed_at, history, out_slot_of, out_request_ids, out_parent_ids, out_token_ids,
                      out_draft_probs, out_path_probs, out_ranks, out_slots, num_frontier, num_active, claimed, gain);
}

int echo_replay_level_next_host(const int64_t* prev_request_ids, const float* prev_path_probs,
                                const int64_t* prev_slots, int32_t num_prev, int32_t slot_width, const int64_t* front,
                                const uint8_t* fvalid, const float* probs, const int64_t* tokens, int32_t num_rows,
                                int32_t width, int32_t children, const int64_t* row_of, int32_t batch_size,
                                int32_t depth, int32_t max_levels, int32_t has_tau, float tau, int32_t budget_stop,
                                int32_t budget_spare, const echo_segments* fit, int32_t gain_row,
                                const uint8_t* active_in, uint8_t* active_out, int64_t* spine_depth,
                                int64_t* failed_at, float* history, int64_t* out_slot_of, int64_t* out_request_ids,
                                int64_t* out_parent_ids, int64_t* out_token_ids, float* out_draft_probs,
                                float* out_path_probs, int64_t* out_ranks, int64_t* out_slots, int32_t* num_frontier,
                                int32_t* num_active, int64_t* claimed, double* gain, const float* parent_path,
                                int32_t next_width, int64_t* out_keep, int64_t* out_front, uint8_t* out_fvalid,
                                float* out_parent_path, int64_t* out_next_tokens, int64_t* out_next_parents,
                                int32_t* num_kept, int32_t* next_slots) {
  const char* who = "replay_level_next";
  ECHO_REQUIRE(next_width >= 1, "%s: next_width must be >= 1, got %d", who, next_width);
  ECHO_REQUIRE(num_kept && next_slots && (num_rows == 0 || (parent_path && out_keep && out_front && out_fvalid &&
                                                            out_parent_path && out_next_tokens && out_next_parents)),
               "%s: a required next-level array is NULL (parent_path, out_keep, out_front, out_fvalid, "
               "out_parent_path, out_next_tokens, out_next_parents, num_kept, next_slots)", who);
  *num_kept = 0;
  *next_slots = 0;
  if (int rc = replay_level(who, prev_request_ids, prev_path_probs, prev_slots, num_prev, slot_width, front, fvalid,
                            probs, tokens, num_rows, width, children, row_of, batch_size, depth, max_levels, has_tau,
                            tau, budget_stop, budget_spare, fit, gain_row, active_in, active_out, spine_depth,
                            failed_at, history, out_slot_of, out_request_ids, out_parent_ids, out_token_ids,
                            out_draft_probs, out_path_probs, out_ranks, out_slots, num_frontier, num_active, claimed,
                            gain))
    return rc;
  if (*num_frontier == 0 || *num_active == 0) return abi::ok();
  // each row's request (row_of's inverse; replay_level checked row_of's range)
  std::vector<int64_t> request_of(static_cast<size_t>(num_rows), -1);
  for (int32_t b = 0; b < batch_size; ++b)
    if (row_of[b] < num_rows) request_of[static_cast<size_t>(row_of[b])] = b;
  // the next level's frontier of every row still drafting: its next_width best slots of this level, in slot order
  const int32_t slots = width * children;
  const int32_t w = std::min(next_width, slots);
  std::vector<float> score(static_cast<size_t>(slots));
  std::vector<int32_t> order(static_cast<size_t>(slots));
  int32_t kept = 0;
  for (int32_t r = 0; r < num_rows; ++r) {
    const int64_t b = request_of[static_cast<size_t>(r)];
    if (b < 0 || !active_out[b]) continue;
    for (int32_t s = 0; s < slots; ++s) {
      score[static_cast<size_t>(s)] = device_score(parent_path, fvalid, probs, width, children, r, s);
      order[static_cast<size_t>(s)] = s;
    }
    if (w < slots) {
      std::partial_sort(order.begin(), order.begin() + w, order.end(),
                        [&](int32_t a, int32_t c) { return scored_before(score.data(), a, c); });
      std::sort(order.begin(), order.begin() + w);
    }
    out_keep[kept] = r;
    for (int32_t j = 0; j < w; ++j) {
      const int32_t s = order[static_cast<size_t>(j)];
      const size_t o = static_cast<size_t>(kept) * w + j;
      const float p = score[static_cast<size_t>(s)];
      out_front[o] = s;
      out_parent_path[o] = p;
      out_fvalid[o] = p >= 0.0f;
      out_next_tokens[o] = tokens[static_cast<size_t>(r) * slots + s];
      out_next_parents[o] = s / children;
    }
    ++kept;
  }
  *num_kept = kept;
  *next_slots = w;
  return abi::ok();
}

int echo_acceptance_observe_host(const int64_t* depths, const float* confidences, const uint8_t* greedy,
                                 int32_t num_nodes, const int64_t* accepted_ids, int32_t num_accepted,
                                 int32_t max_depth, const double* edges, int32_t num_bins, double decay, double* n,
                                 double* k, double* csum) {
  const char* who = "acceptance_observe";
  ECHO_REQUIRE(num_nodes >= 0 && num_accepted >= 0, "%s: num_nodes and num_accepted must be >= 0, got %d and %d",
               who, num_nodes, num_accepted);
  ECHO_REQUIRE(max_depth >= 1 && num_bins >= 1, "%s: max_depth and num_bins must be >= 1, got %d and %d", who,
               max_depth, num_bins);
  ECHO_REQUIRE(edges && n && k && csum, "%s: a required array is NULL (edges, n, k, csum)", who);
  ECHO_REQUIRE(num_nodes == 0 || (depths && confidences && greedy), "%s: a required node array is NULL", who);
  ECHO_REQUIRE(num_accepted == 0 || accepted_ids, "%s: accepted_ids is NULL", who);
  ECHO_REQUIRE(decay >= 0.0 && decay <= 1.0, "%s: decay must be in [0, 1], got %g", who, decay);
  std::vector<uint8_t> accepted(static_cast<size_t>(num_nodes), 0);
  for (int32_t i = 0; i < num_accepted; ++i) {
    ECHO_REQUIRE(accepted_ids[i] >= 0 && accepted_ids[i] < num_nodes, "%s: accepted_ids[%d] = %lld is outside [0, %d)",
                 who, i, static_cast<long long>(accepted_ids[i]), num_nodes);
    accepted[accepted_ids[i]] = 1;
  }
  const size_t cells = static_cast<size_t>(2 * max_depth) * num_bins;
  for (size_t j = 0; j < cells; ++j) {
    n[j] *= decay;
    k[j] *= decay;
    csum[j] *= decay;
  }
  // the step's sums per cell first, then added (as NumPy adds a bincount): the same rounding
  std::vector<double> dn(cells, 0.0), dk(cells, 0.0), dc(cells, 0.0);
  bool any = false;
  for (int32_t i = 0; i < num_nodes; ++i) {
    if (depths[i] <= 0) continue;  // a root is not a draft
    any = true;
    const double c = clamp01(static_cast<double>(confidences[i]));
    const int64_t d = std::min<int64_t>(depths[i], max_depth) - 1;
    const int64_t row = d + (greedy[i] ? 0 : max_depth);
    int32_t bin = static_cast<int32_t>(std::upper_bound(edges, edges + num_bins + 1, c) - edges) - 1;
    bin = std::min(std::max(bin, 0), num_bins - 1);
    const size_t cell = static_cast<size_t>(row) * num_bins + bin;
    dn[cell] += 1.0;
    dk[cell] += accepted[i] ? 1.0 : 0.0;
    dc[cell] += c;
  }
  if (any)
    for (size_t j = 0; j < cells; ++j) {
      n[j] += dn[j];
      k[j] += dk[j];
      csum[j] += dc[j];
    }
  return abi::ok();
}

int echo_tree_from_levels_host(const int64_t* level_sizes, int32_t num_levels, const int64_t* request_ids,
                               const int64_t* parent_ids, const int64_t* token_ids, const float* draft_probs,
                               const float* path_probs, const int64_t* ranks, int64_t* out_token_ids,
                               int64_t* out_parents, int64_t* out_depths, float* out_draft_probs,
                               float* out_path_probs, int64_t* out_ranks, int64_t* out_cu, int64_t* out_source,
                               int64_t* out_request_ids, int64_t* out_global_parents, uint8_t* out_greedy) {
  const char* who = "tree_from_levels";
  ECHO_REQUIRE(num_levels >= 1 && level_sizes, "%s: num_levels must be >= 1 (the roots first), got %d", who,
               num_levels);
  ECHO_REQUIRE(level_sizes[0] >= 1, "%s: the root level must hold every request (>= 1), got %lld", who,
               static_cast<long long>(level_sizes[0]));
  const int64_t b = level_sizes[0];
  std::vector<int64_t> start(static_cast<size_t>(num_levels) + 1, 0);
  for (int32_t d = 0; d < num_levels; ++d) {
    ECHO_REQUIRE(level_sizes[d] >= 0, "%s: level_sizes[%d] = %lld must be >= 0", who, d,
                 static_cast<long long>(level_sizes[d]));
    start[d + 1] = start[d] + level_sizes[d];
  }
  const int64_t n = start[num_levels];
  ECHO_REQUIRE(request_ids && parent_ids && token_ids && draft_probs && path_probs && ranks && out_token_ids &&
                   out_parents && out_depths && out_draft_probs && out_path_probs && out_ranks && out_cu && out_source &&
                   out_request_ids && out_global_parents && out_greedy,
               "%s: a required array is NULL", who);
  for (int32_t d = 0; d < num_levels; ++d)
    for (int64_t i = start[d]; i < start[d + 1]; ++i) {
      ECHO_REQUIRE(request_ids[i] >= 0 && request_ids[i] < b, "%s: request_ids[%lld] = %lld is outside [0, %lld)", who,
                   static_cast<long long>(i), static_cast<long long>(request_ids[i]), static_cast<long long>(b));
      if (d == 0) {
        ECHO_REQUIRE(request_ids[i] == i && parent_ids[i] == -1,
                     "%s: the root level must be request i's root at i with parent -1 (node %lld)", who,
                     static_cast<long long>(i));
        continue;
      }
      const int64_t p = parent_ids[i];
      ECHO_REQUIRE(p >= 0 && p < level_sizes[d - 1], "%s: parent_ids[%lld] = %lld is outside level %d's %lld nodes",
                   who, static_cast<long long>(i), static_cast<long long>(p), d - 1,
                   static_cast<long long>(level_sizes[d - 1]));
      ECHO_REQUIRE(request_ids[start[d - 1] + p] == request_ids[i],
                   "%s: node %lld of request %lld has a parent of request %lld", who, static_cast<long long>(i),
                   static_cast<long long>(request_ids[i]), static_cast<long long>(request_ids[start[d - 1] + p]));
    }
  // request-major, level-major within a request (a stable counting sort by request)
  out_cu[0] = 0;
  std::vector<int64_t> next(static_cast<size_t>(b), 0);
  for (int64_t i = 0; i < n; ++i) ++next[request_ids[i]];
  for (int64_t r = 0; r < b; ++r) out_cu[r + 1] = out_cu[r] + next[r];
  for (int64_t r = 0; r < b; ++r) next[r] = out_cu[r];
  std::vector<int64_t> new_index(static_cast<size_t>(n));
  std::vector<uint8_t> greedy(static_cast<size_t>(n));
  for (int32_t d = 0; d < num_levels; ++d)
    for (int64_t i = start[d]; i < start[d + 1]; ++i) {
      const int64_t r = request_ids[i];
      const int64_t j = next[r]++;
      new_index[i] = j;
      const int64_t flat_parent = d == 0 ? -1 : start[d - 1] + parent_ids[i];
      greedy[i] = d == 0 ? 1 : (greedy[flat_parent] && ranks[i] == 0);
      const int64_t gp = d == 0 ? -1 : new_index[flat_parent];  // parents come from earlier levels: known
      out_source[j] = i;
      out_token_ids[j] = token_ids[i];
      out_depths[j] = d;
      out_draft_probs[j] = draft_probs[i];
      out_path_probs[j] = path_probs[i];
      out_ranks[j] = ranks[i];
      out_request_ids[j] = r;
      out_global_parents[j] = gp;
      out_parents[j] = gp >= 0 ? gp - out_cu[r] : -1;
      out_greedy[j] = greedy[i];
    }
  return abi::ok();
}

}  // extern "C"

namespace {

// pool adjacent violators over one row (core.acceptance._weighted_isotonic: a block's mean is (m w + m' w') / (w + w'),
// pooled left to right); the scratch is kept across rows
struct Pav {
  std::vector<double> means, weights;
  std::vector<int32_t> sizes;

  void fit(const double* y, const double* w, int32_t cols, double* out) {
    means.clear();
    weights.clear();
    sizes.clear();
    for (int32_t i = 0; i < cols; ++i) {
      means.push_back(y[i]);
      weights.push_back(w[i]);
      sizes.push_back(1);
      while (means.size() > 1 && means[means.size() - 2] > means.back()) {
        const double m1 = means.back(), w1 = weights.back();
        const int32_t s1 = sizes.back();
        means.pop_back();
        weights.pop_back();
        sizes.pop_back();
        means.back() = (means.back() * weights.back() + m1 * w1) / (weights.back() + w1);
        weights.back() += w1;
        sizes.back() += s1;
      }
    }
    for (size_t j = 0; j < means.size(); ++j)
      for (int32_t t = 0; t < sizes[j]; ++t) *out++ = means[j];
  }
};

// OnlineAcceptance._bins: the bin of x clamped to [0, 1]
inline int32_t bin_of(const double* edges, int32_t num_bins, double x) {
  const int32_t b = static_cast<int32_t>(std::upper_bound(edges, edges + num_bins + 1, clamp01(x)) - edges) - 1;
  return std::min(std::max(b, 0), num_bins - 1);
}

// where x falls on a row's P ascending points (core.acceptance._segments_rows): i = #{xs <= x} clamped to
// [1, P - 1] and the position u in [xs[i - 1], xs[i]], clamped to [0, 1]
struct Point {
  int32_t i;
  double u;
  double on(const double* ys) const { return ys[i - 1] + (ys[i] - ys[i - 1]) * u; }  // core.acceptance._lerp
};

inline Point point_on(const double* xs, int32_t p, double x) {
  int32_t i = 0;
  for (int32_t j = 0; j < p; ++j) i += xs[j] <= x;
  i = std::min(std::max(i, 1), p - 1);
  const double x0 = xs[i - 1], x1 = xs[i];
  return {i, clamp01((x - x0) / std::max(x1 - x0, 1e-12))};
}

// the refit's rows as echo_acceptance_refit_host reads and writes them
struct Refit {
  const double *n, *k, *mid, *edges;
  int32_t depth, bins;
  double w0;
  double *centres, *values, *p0;

  // OnlineAcceptance._from_first on row 0's fit: e1(c^(1/d))^d
  double from_first(double c, double d) const {
    c = clamp01(c);
    const double x = std::pow(c, 1.0 / d);
    const double share = w0 / (n[bin_of(edges, bins, x)] + w0);
    const Point at = point_on(centres, bins, x);
    const double e1 = clamp01((at.on(values) - share * at.on(p0)) + share * x);
    const double ratio = x > 0.0 ? e1 / x : 0.0;
    return x > 0.0 ? c * std::pow(ratio, d) : std::pow(e1, d);
  }

  // OnlineAcceptance._fit: centres, priors, isotonic values
  void fit(const double* csum, const double* p0_in) {
    const int32_t cells = 2 * depth * bins;
    std::vector<double> weight(cells), raw(cells);
    for (int32_t j = 0; j < cells; ++j) {
      weight[j] = n[j] + w0;
      centres[j] = n[j] > 1e-9 ? csum[j] / std::max(n[j], 1e-12) : mid[j];
      p0[j] = p0_in[j];
    }
    Pav pav;
    for (int32_t j = 0; j < bins; ++j) raw[j] = (k[j] + w0 * p0[j]) / weight[j];
    pav.fit(raw.data(), weight.data(), bins, values);
    for (int32_t r = 1; r < depth; ++r)  // the greedy rows' priors from depth 1
      for (int32_t j = 0; j < bins; ++j) p0[r * bins + j] = from_first(mid[r * bins + j], r + 1.0);
    for (int32_t j = bins; j < cells; ++j) raw[j] = (k[j] + w0 * p0[j]) / weight[j];
    for (int32_t r = 1; r < 2 * depth; ++r)
      pav.fit(raw.data() + r * bins, weight.data() + r * bins, bins, values + r * bins);
  }

  // OnlineAcceptance._segments_table: each row's starts (bin edges and centres, sorted), the linear part and share,
  // written to out (7 arrays of 2 depth x 2 bins) and returned as the table echo_acceptance_estimate_host reads
  echo_segments segments(double* out, const uint8_t* deep) const {
    const int32_t per_row = 2 * bins, total = 2 * depth * per_row;
    double *keys = out, *start = out + total, *l0 = out + 2 * total, *l1 = out + 3 * total;
    double *share = out + 4 * total, *e0 = out + 5 * total, *e1 = out + 6 * total;
    std::vector<double> starts(per_row);
    for (int32_t r = 0; r < 2 * depth; ++r) {
      const double *c = centres + r * bins, *v = values + r * bins, *p = p0 + r * bins;
      std::copy(edges, edges + bins, starts.begin());
      std::copy(c, c + bins, starts.begin() + bins);
      std::sort(starts.begin(), starts.end());
      for (int32_t s = 0; s < per_row; ++s) {
        const int32_t g = r * per_row + s;
        const double a = starts[s], b = s + 1 < per_row ? starts[s + 1] : 1.0;
        const double sh = w0 / (n[r * bins + bin_of(edges, bins, (a + b) / 2)] + w0);
        const Point pa = point_on(c, bins, a), pb = point_on(c, bins, b);
        const double la = pa.on(v) - sh * pa.on(p), lb = pb.on(v) - sh * pb.on(p);
        keys[g] = r * 2.0 + a;
        start[g] = a;
        l0[g] = la;
        l1[g] = b > a ? (lb - la) / (b - a) : 0.0;
        share[g] = sh;
        e0[g] = 0.0;
        e1[g] = 1.0;
      }
    }
    return {keys, start, l0, l1, share, e0, e1, total, deep, 2 * depth};
  }
};

}  // namespace

extern "C" {

int echo_isotonic_rows_host(const double* y, const double* w, int32_t rows, int32_t cols, double* out) {
  const char* who = "isotonic_rows";
  ECHO_REQUIRE(rows >= 0 && cols >= 0, "%s: rows and cols must be >= 0, got %d and %d", who, rows, cols);
  const size_t cells = static_cast<size_t>(rows) * static_cast<size_t>(cols);
  ECHO_REQUIRE(cells == 0 || (y && w && out), "%s: a required array is NULL (y, w, out)", who);
  for (size_t i = 0; i < cells; ++i)
    ECHO_REQUIRE(w[i] > 0.0, "%s: weights must be > 0, w[%zu] = %g", who, i, w[i]);
  Pav pav;
  for (int32_t r = 0; r < rows; ++r) {
    const size_t at = static_cast<size_t>(r) * cols;
    pav.fit(y + at, w + at, cols, out + at);
  }
  return abi::ok();
}

int echo_copy_rows_host(void* dst, int64_t dst_rows, int64_t dst_stride, const int64_t* dst_index, const void* src,
                        int64_t src_rows, int64_t src_stride, const int64_t* src_index, int64_t n, int64_t row_bytes) {
  const char* who = "copy_rows";
  ECHO_REQUIRE(n >= 0 && row_bytes >= 1 && dst_stride >= row_bytes && src_stride >= row_bytes,
               "%s: n must be >= 0, row_bytes >= 1 and the strides >= row_bytes, got %lld, %lld, %lld and %lld", who,
               static_cast<long long>(n), static_cast<long long>(row_bytes), static_cast<long long>(dst_stride),
               static_cast<long long>(src_stride));
  ECHO_REQUIRE(n == 0 || (dst && src && dst_index), "%s: a required array is NULL (dst, src, dst_index)", who);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t d = dst_index[i], s = src_index ? src_index[i] : i;
    ECHO_REQUIRE(d >= 0 && d < dst_rows, "%s: dst_index[%lld] = %lld is outside [0, %lld)", who,
                 static_cast<long long>(i), static_cast<long long>(d), static_cast<long long>(dst_rows));
    ECHO_REQUIRE(s >= 0 && s < src_rows, "%s: src_index[%lld] = %lld is outside [0, %lld)", who,
                 static_cast<long long>(i), static_cast<long long>(s), static_cast<long long>(src_rows));
  }
  char* out = static_cast<char*>(dst);
  const char* in = static_cast<const char*>(src);
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(out + dst_index[i] * dst_stride, in + (src_index ? src_index[i] : i) * src_stride,
                static_cast<size_t>(row_bytes));
  return abi::ok();
}

int echo_acceptance_refit_host(const double* n, const double* k, const double* csum, const double* mid,
                               const double* p0, int32_t max_depth, const double* edges, int32_t num_bins,
                               double prior_weight, const double* grid, int32_t num_grid, double* fit,
                               double* segments, double* grid_out) {
  const char* who = "acceptance_refit";
  ECHO_REQUIRE(max_depth >= 1 && num_bins >= 2 && num_grid >= 0,
               "%s: max_depth must be >= 1, num_bins >= 2 and num_grid >= 0, got %d, %d and %d", who, max_depth,
               num_bins, num_grid);
  ECHO_REQUIRE(n && k && csum && mid && p0 && edges && fit && segments,
               "%s: a required array is NULL (n, k, csum, mid, p0, edges, fit, segments)", who);
  ECHO_REQUIRE(num_grid == 0 || (grid && grid_out), "%s: grid or grid_out is NULL", who);
  ECHO_REQUIRE(prior_weight > 0.0, "%s: prior_weight must be > 0, got %g", who, prior_weight);
  ECHO_REQUIRE(edges[0] == 0.0 && edges[num_bins] == 1.0, "%s: edges must run from 0 to 1, got %g to %g", who,
               edges[0], edges[num_bins]);
  for (int32_t j = 0; j < num_bins; ++j)
    ECHO_REQUIRE(edges[j] < edges[j + 1], "%s: edges must be ascending, edges[%d] = %g >= edges[%d] = %g", who, j,
                 edges[j], j + 1, edges[j + 1]);
  ECHO_REQUIRE(max_depth <= (1 << 16) && num_bins <= (1 << 10),
               "%s: max_depth must be <= 65536 and num_bins <= 1024, got %d and %d", who, max_depth, num_bins);
  const int32_t rows = 2 * max_depth, cells = rows * num_bins;
  for (int32_t j = 0; j < cells; ++j) {  // a NaN would reach the segments' sort: refused, as a negative count
    ECHO_REQUIRE(n[j] >= 0.0 && std::isfinite(n[j]), "%s: counts must be finite and >= 0, n[%d] = %g", who, j, n[j]);
    ECHO_REQUIRE(std::isfinite(k[j]) && std::isfinite(csum[j]) && std::isfinite(p0[j]) && std::isfinite(mid[j]),
                 "%s: k, csum, p0 and mid must be finite, got %g, %g, %g and %g at cell %d", who, k[j], csum[j],
                 p0[j], mid[j], j);
  }
  Refit refit{n, k, mid, edges, max_depth, num_bins, prior_weight, fit, fit + cells, fit + 2 * cells};
  refit.fit(csum, p0);
  std::vector<uint8_t> deep(static_cast<size_t>(rows), 0);  // the greedy rows below depth 1
  for (int32_t r = 1; r < max_depth; ++r) deep[r] = 1;
  const echo_segments table = refit.segments(segments, deep.data());
  for (int32_t r = 0; r < max_depth; ++r)
    for (int32_t g = 0; g < num_grid; ++g) grid_out[r * num_grid + g] = estimate_one(table, grid[g], r);
  return abi::ok();
}

int echo_tree_select_host(int64_t n, int64_t b, const uint8_t* mask, const int64_t* request_ids,
                          const int64_t* global_parents, const int64_t* token_ids, const int64_t* depths,
                          const float* draft_probs, const float* path_probs, const int64_t* ranks,
                          const int64_t* source, const uint8_t* greedy, int64_t* out_m, int64_t* out_token_ids,
                          int64_t* out_parents, int64_t* out_depths, float* out_draft_probs, float* out_path_probs,
                          int64_t* out_ranks, int64_t* out_source, int64_t* out_request_ids,
                          int64_t* out_global_parents, uint8_t* out_greedy, int64_t* out_cu) {
  const char* who = "tree_select";
  ECHO_REQUIRE(n >= 0 && b >= 0 && (b >= 1 || n == 0), "%s: n must be >= 0 and b >= 1 (0 for an empty tree), got "
               "%lld and %lld", who, static_cast<long long>(n), static_cast<long long>(b));
  ECHO_REQUIRE(out_m && out_cu && (n == 0 || (mask && request_ids && global_parents && token_ids && depths &&
                                              draft_probs && path_probs && ranks && source && out_token_ids &&
                                              out_parents && out_depths && out_draft_probs && out_path_probs &&
                                              out_ranks && out_source && out_request_ids && out_global_parents)),
               "%s: a required array is NULL", who);
  ECHO_REQUIRE(!greedy || n == 0 || out_greedy, "%s: greedy given without out_greedy", who);
  std::vector<int64_t> new_index(static_cast<size_t>(n), -1);
  std::vector<int64_t> counts(static_cast<size_t>(b), 0);
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {  // the arrays, and every root kept (checked before any orphan, as the core)
    const int64_t r = request_ids[i], gp = global_parents[i];
    ECHO_REQUIRE(r >= 0 && r < b, "%s: request_ids[%lld] = %lld is outside [0, %lld)", who,
                 static_cast<long long>(i), static_cast<long long>(r), static_cast<long long>(b));
    ECHO_REQUIRE(gp >= -1 && gp < i, "%s: global_parents[%lld] = %lld must be -1 or an earlier node", who,
                 static_cast<long long>(i), static_cast<long long>(gp));
    ECHO_REQUIRE(gp >= 0 || mask[i], "selection must keep every request's root");
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = request_ids[i], gp = global_parents[i];
    if (!mask[i]) continue;
    ECHO_REQUIRE(gp < 0 || mask[gp], "selection is not ancestor-closed: node %lld lacks its parent",
                 static_cast<long long>(i));
    new_index[i] = m++;
    ++counts[r];
  }
  out_cu[0] = 0;
  for (int64_t r = 0; r < b; ++r) out_cu[r + 1] = out_cu[r] + counts[r];
  for (int64_t i = 0; i < n; ++i) {
    const int64_t j = new_index[i];
    if (j < 0) continue;
    const int64_t r = request_ids[i], gp = global_parents[i];
    const int64_t g = gp >= 0 ? new_index[gp] : -1;
    out_token_ids[j] = token_ids[i];
    out_parents[j] = g >= 0 ? g - out_cu[r] : -1;
    out_depths[j] = depths[i];
    out_draft_probs[j] = draft_probs[i];
    out_path_probs[j] = path_probs[i];
    out_ranks[j] = ranks[i];
    out_source[j] = source[i];
    out_request_ids[j] = r;
    out_global_parents[j] = g;
    if (greedy) out_greedy[j] = greedy[i];
  }
  *out_m = m;
  return abi::ok();
}

int echo_kalman_step_host(int32_t n, double* theta, double* cov, const double* phi, double y, const double* cap,
                          const double* floor, double drift_common, double drift_each, int32_t drift_now, double huber,
                          double* noise, double noise_floor, double noise_rate, double min_seconds, double* out) {
  const char* who = "kalman_step";
  ECHO_REQUIRE(n >= 1, "%s: n must be >= 1, got %d", who, n);
  ECHO_REQUIRE(theta && cov && phi && cap && floor && noise && out,
               "%s: a required array is NULL (theta, cov, phi, cap, floor, noise, out)", who);
  ECHO_REQUIRE(std::isfinite(y), "%s: the measurement must be finite, got %g", who, y);
  const size_t m = static_cast<size_t>(n);
  auto at = [&](size_t i, size_t j) -> double& { return cov[i * m + j]; };
  if (drift_now) {  // KalmanLinear.advance: common and independent drift, the cap, symmetry restored
    for (size_t i = 0; i < m; ++i)
      for (size_t j = 0; j < m; ++j) at(i, j) += drift_common * (theta[i] * theta[j]);
    std::vector<double> d(m, 1.0);
    bool over = false;
    for (size_t i = 0; i < m; ++i) {
      const double level = std::max(theta[i], floor[i]);
      at(i, i) += drift_each * (level * level);
      if (at(i, i) > cap[i]) {
        d[i] = std::sqrt(cap[i] / at(i, i));
        over = true;
      }
    }
    if (over)
      for (size_t i = 0; i < m; ++i)
        for (size_t j = 0; j < m; ++j) at(i, j) *= d[i] * d[j];
    for (size_t i = 0; i < m; ++i)
      for (size_t j = i + 1; j < m; ++j) at(i, j) = at(j, i) = (at(i, j) + at(j, i)) * 0.5;
  }
  // KalmanLinear.update
  double dot = 0.0;
  for (size_t i = 0; i < m; ++i) dot += phi[i] * theta[i];
  const double predicted = std::max(dot, min_seconds);
  const double r = y - predicted;
  const double scale = std::max(std::max(predicted, y), min_seconds);
  const double noise_var = (*noise * scale) * (*noise * scale);
  std::vector<double> p_phi(m, 0.0);
  double s = noise_var, phi_p = 0.0;
  for (size_t i = 0; i < m; ++i) {
    for (size_t j = 0; j < m; ++j) p_phi[i] += at(i, j) * phi[j];
    phi_p += phi[i] * p_phi[i];
  }
  s += phi_p;
  ECHO_REQUIRE(s > 0.0, "%s: the innovation's variance must be > 0, got %g", who, s);
  const double bound = huber * std::sqrt(s);
  const double clipped = std::max(-bound, std::min(bound, r));
  for (size_t i = 0; i < m; ++i) theta[i] += (p_phi[i] / s) * clipped;
  for (size_t i = 0; i < m; ++i)
    for (size_t j = 0; j < m; ++j) at(i, j) -= (p_phi[i] / s) * p_phi[j];
  // KalmanLinear._project: theta >= 0 in cov's metric
  std::vector<char> held(m, 0);
  std::vector<size_t> a;
  std::vector<double> lu, x;
  for (size_t it = 0; it < m; ++it) {
    bool any = false;
    for (size_t i = 0; i < m; ++i)
      if (theta[i] < 0.0) held[i] = 1, any = true;
    if (!any) break;
    a.clear();
    for (size_t i = 0; i < m; ++i)
      if (held[i]) a.push_back(i);
    const size_t k = a.size();
    double trace = 0.0;
    for (size_t p = 0; p < k; ++p) trace += at(a[p], a[p]);
    const double jitter = 1e-12 * std::max(trace / static_cast<double>(k), 1e-30);
    lu.assign(k * k, 0.0);
    x.assign(k, 0.0);
    for (size_t p = 0; p < k; ++p) {
      for (size_t q = 0; q < k; ++q) lu[p * k + q] = at(a[p], a[q]);
      lu[p * k + p] += jitter;
      x[p] = theta[a[p]];
    }
    for (size_t c = 0; c < k; ++c) {  // Gaussian elimination with partial pivoting
      size_t piv = c;
      for (size_t p = c + 1; p < k; ++p)
        if (std::fabs(lu[p * k + c]) > std::fabs(lu[piv * k + c])) piv = p;
      ECHO_REQUIRE(lu[piv * k + c] != 0.0, "%s: the held coefficients' covariance is singular", who);
      if (piv != c) {
        for (size_t q = 0; q < k; ++q) std::swap(lu[c * k + q], lu[piv * k + q]);
        std::swap(x[c], x[piv]);
      }
      for (size_t p = c + 1; p < k; ++p) {
        const double f = lu[p * k + c] / lu[c * k + c];
        for (size_t q = c; q < k; ++q) lu[p * k + q] -= f * lu[c * k + q];
        x[p] -= f * x[c];
      }
    }
    for (size_t c = k; c-- > 0;) {
      double v = x[c];
      for (size_t q = c + 1; q < k; ++q) v -= lu[c * k + q] * x[q];
      x[c] = v / lu[c * k + c];
    }
    for (size_t i = 0; i < m; ++i) {
      double corr = 0.0;
      for (size_t p = 0; p < k; ++p) corr += at(i, a[p]) * x[p];
      theta[i] -= corr;
    }
    for (size_t p = 0; p < k; ++p) theta[a[p]] = 0.0;
  }
  for (size_t i = 0; i < m; ++i) theta[i] = std::max(theta[i], 0.0);  // rounding
  const double rel = std::fabs(clipped) / scale;
  *noise = std::max(noise_floor, (1 - noise_rate) * *noise + noise_rate * 1.2533 * rel);
  out[0] = predicted;
  out[1] = noise_var;
  return abi::ok();
}

int echo_accept_greedy_host(const int64_t* input_ids, const int64_t* pred, const int32_t* parents,
                            const int32_t* depths, const int32_t* cu, int32_t batch_size, int32_t num_nodes,
                            int32_t width, int64_t* nodes, int64_t* tokens, int64_t* counts) {
  ECHO_REQUIRE(pred, "accept_greedy: a required array is NULL");
  return accept_greedy("accept_greedy", input_ids, parents, depths, cu, batch_size, num_nodes, width, nodes, tokens,
                       counts, [pred](int32_t j) { return pred[j]; });
}

int echo_accept_greedy_logits_host(const void* logits, int64_t row_stride, int64_t vocab, int32_t dtype,
                                   const int64_t* input_ids, const int32_t* parents, const int32_t* depths,
                                   const int32_t* cu, int32_t batch_size, int32_t num_nodes, int32_t width,
                                   int64_t* nodes, int64_t* tokens, int64_t* counts, int64_t* pred) {
  const char* who = "accept_greedy_logits";
  ECHO_REQUIRE(logits && pred, "%s: a required array is NULL", who);
  ECHO_REQUIRE(vocab >= 1 && row_stride >= vocab, "%s: vocab must be >= 1 and row_stride >= vocab, got %lld, %lld",
               who, static_cast<long long>(vocab), static_cast<long long>(row_stride));
  ECHO_REQUIRE(dtype == 0 || dtype == 1, "%s: dtype must be 0 (float32) or 1 (bfloat16), got %d", who, dtype);
  ECHO_REQUIRE(vocab <= std::numeric_limits<int32_t>::max() - kLanes, "%s: vocab must be below 2^31 - %d (the "
               "argmax's lanes count in 32 bits), got %lld", who, kLanes, static_cast<long long>(vocab));
  for (int32_t j = 0; j < num_nodes; ++j) pred[j] = -1;
  // a node's top-1 is read the first time the walk needs it: after a node on an accepted path, and the path's last
  return accept_greedy(who, input_ids, parents, depths, cu, batch_size, num_nodes, width, nodes, tokens, counts,
                       [=](int32_t j) {
                         if (pred[j] < 0) {
                           const size_t at = static_cast<size_t>(j) * static_cast<size_t>(row_stride);
                           pred[j] = dtype == 0 ? argmax_row(static_cast<const float*>(logits) + at, vocab)
                                                : argmax_row(static_cast<const uint16_t*>(logits) + at, vocab);
                         }
                         return pred[j];
                       });
}

int echo_draft_result_host(const int64_t* level_sizes, int32_t num_levels, const int64_t* request_ids,
                           const int64_t* parent_ids, const int64_t* token_ids, const float* draft_probs,
                           const float* path_probs, const int64_t* ranks, const int32_t* spine_depth, int32_t budget,
                           int32_t max_nodes_per_request, const echo_segments* fit, int32_t max_depth,
                           const double* seconds, int32_t num_seconds, int32_t min_taken,
                           const int32_t* context_lengths, int64_t* tree_ints, float* tree_floats, int64_t* tree_cu,
                           uint8_t* tree_greedy, uint8_t* selected, int8_t* phase, int32_t* num_nodes_out,
                           int32_t* order, int32_t* order_len, int64_t* sel_ints, float* sel_floats,
                           uint8_t* sel_greedy, int64_t* sel_cu, int64_t* num_selected, int64_t* input_ids,
                           int64_t* position_ids, int32_t* packed_ints, int32_t* offsets, int64_t offsets_capacity,
                           int32_t* packed_mask, int64_t mask_capacity, int32_t* n_max_out) {
  const char* who = "draft_result";
  ECHO_REQUIRE(level_sizes && num_levels >= 1, "%s: num_levels must be >= 1 (the roots first), got %d", who,
               num_levels);
  ECHO_REQUIRE(tree_ints && tree_floats && tree_cu && tree_greedy && selected && phase && num_nodes_out && order &&
                   order_len && sel_ints && sel_floats && sel_greedy && sel_cu && num_selected && input_ids &&
                   position_ids && packed_ints && offsets && packed_mask && n_max_out && context_lengths &&
                   spine_depth,
               "%s: a required array is NULL", who);
  int64_t n = 0;
  for (int32_t l = 0; l < num_levels; ++l) {
    ECHO_REQUIRE(level_sizes[l] >= 0, "%s: level %d has %lld nodes", who, l, static_cast<long long>(level_sizes[l]));
    n += level_sizes[l];
  }
  const int64_t b = level_sizes[0];
  ECHO_REQUIRE(b >= 1 && n <= std::numeric_limits<int32_t>::max(), "%s: the roots must number >= 1 and the tree "
               "below 2^31 nodes, got %lld roots, %lld nodes", who, static_cast<long long>(b),
               static_cast<long long>(n));
  // the Super-Tree (echo_tree_from_levels_host), its rows at stride n: token, parent, depth, rank, source, request,
  // global parent; draft then path probabilities
  int64_t* t = tree_ints;
  if (int rc = echo_tree_from_levels_host(level_sizes, num_levels, request_ids, parent_ids, token_ids, draft_probs,
                                          path_probs, ranks, t, t + n, t + 2 * n, tree_floats, tree_floats + n,
                                          t + 3 * n, tree_cu, t + 4 * n, t + 5 * n, t + 6 * n, tree_greedy))
    return rc;
  // the selection (echo_select_host) over the tree's int32 views
  const int32_t n32 = static_cast<int32_t>(n), b32 = static_cast<int32_t>(b);
  std::vector<int32_t> depths(static_cast<size_t>(n)), parents(static_cast<size_t>(n)), cu(static_cast<size_t>(b + 1));
  for (int64_t i = 0; i < n; ++i) {
    depths[static_cast<size_t>(i)] = static_cast<int32_t>(t[2 * n + i]);
    parents[static_cast<size_t>(i)] = static_cast<int32_t>(t[n + i]);
  }
  for (int64_t r = 0; r <= b; ++r) cu[static_cast<size_t>(r)] = static_cast<int32_t>(tree_cu[r]);
  if (int rc = echo_select_host(tree_floats + n, depths.data(), parents.data(), cu.data(), b32, n32, spine_depth,
                                budget, max_nodes_per_request, selected, phase, num_nodes_out, order, order_len,
                                tree_greedy, fit, max_depth, seconds, num_seconds, min_taken))
    return rc;
  // the selected sub-tree (echo_tree_select_host), its rows at stride n as the tree's
  int64_t* s = sel_ints;
  if (int rc = echo_tree_select_host(n, b, selected, t + 5 * n, t + 6 * n, t, t + 2 * n, tree_floats,
                                     tree_floats + n, t + 3 * n, t + 4 * n, tree_greedy, num_selected, s, s + n,
                                     s + 2 * n, sel_floats, sel_floats + n, s + 3 * n, s + 4 * n, s + 5 * n, s + 6 * n,
                                     sel_greedy, sel_cu))
    return rc;
  // every node of it packed (echo_pack_host): packed_ints' rows at stride m (cu, B + 1 of a row; lengths, B; parents;
  // depths; positions), offsets (B, n_max) and the mask (m, words) each contiguous
  const int32_t m = static_cast<int32_t>(*num_selected);
  int32_t n_max = 0;
  std::vector<int32_t> sel_parents(static_cast<size_t>(m)), sel_cu32(static_cast<size_t>(b + 1));
  for (int32_t i = 0; i < m; ++i) sel_parents[static_cast<size_t>(i)] = static_cast<int32_t>(s[n + i]);
  for (int64_t r = 0; r <= b; ++r) {
    sel_cu32[static_cast<size_t>(r)] = static_cast<int32_t>(sel_cu[r]);
    if (r < b) n_max = std::max(n_max, static_cast<int32_t>(sel_cu[r + 1] - sel_cu[r]));
  }
  const int64_t words = echo::words_per_row(n_max);
  ECHO_REQUIRE(b * n_max <= offsets_capacity && int64_t{m} * words <= mask_capacity, "%s: the packed batch (%d "
               "nodes, n_max %d) needs %lld offsets and %lld mask words, the outputs hold %lld and %lld", who, m,
               n_max, static_cast<long long>(b * n_max), static_cast<long long>(int64_t{m} * words),
               static_cast<long long>(offsets_capacity), static_cast<long long>(mask_capacity));
  std::vector<int32_t> src(static_cast<size_t>(m)), pos(static_cast<size_t>(m));
  int32_t* p = packed_ints;
  if (int rc = echo_pack_host(sel_parents.data(), sel_cu32.data(), nullptr, context_lengths, b32, m, m, n_max, p,
                              p + (b + 1), src.data(), p + (2 * b + 1), p + (2 * b + 1) + m, pos.data(), offsets,
                              packed_mask))
    return rc;
  for (int32_t k = 0; k < m; ++k) {
    input_ids[k] = s[src[static_cast<size_t>(k)]];
    position_ids[k] = pos[static_cast<size_t>(k)];
  }
  *n_max_out = n_max;
  return abi::ok();
}

}  // extern "C"
