// C ABI, host entry points: argument checks, then the reference path of the same headers the kernels use.
// Builds with any C++17 compiler (no CUDA needed): this is what CI tests against echo_trtllm.core.
#include <algorithm>
#include <cmath>
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
  ECHO_REQUIRE(num_segments >= 1 && num_rows >= 1,
               "acceptance_estimate: num_segments and num_rows must be >= 1, got %d and %d", num_segments, num_rows);
  ECHO_REQUIRE(keys && start && l0 && l1 && share && e0 && e1 && (num_nodes == 0 || (confidences && rows && out)),
               "acceptance_estimate: a required array is NULL (confidences, rows, keys, start, l0, l1, share, e0, "
               "e1, out)");
  ECHO_REQUIRE(keys[0] <= 0.0, "acceptance_estimate: the first segment must start at key 0 (row 0, confidence 0), "
               "got %g", keys[0]);
  for (int32_t s = 1; s < num_segments; ++s)
    ECHO_REQUIRE(keys[s - 1] <= keys[s], "acceptance_estimate: keys must be ascending, keys[%d] = %g > keys[%d] = %g",
                 s - 1, keys[s - 1], s, keys[s]);
  for (int32_t i = 0; i < num_nodes; ++i) {
    ECHO_REQUIRE(rows[i] >= 0 && rows[i] < num_rows, "acceptance_estimate: rows[%d] = %d is outside [0, %d)", i,
                 rows[i], num_rows);
  }
  for (int32_t i = 0; i < num_nodes; ++i) {
    if (std::isnan(confidences[i])) {  // NaN in, NaN out (as the NumPy read gives)
      out[i] = confidences[i];
      continue;
    }
    const double c = clamp01(confidences[i]);
    const int32_t r = rows[i];
    const int32_t s = segment_of(keys, num_segments, 2.0 * r + c);
    double prior = e0[s] + e1[s] * c;
    if (deep && deep[r]) {
      const double d = r + 1.0;
      const double x = std::pow(c, 1.0 / d);
      const int32_t t = segment_of(keys, num_segments, x);
      const double e = clamp01(l0[t] + l1[t] * (x - start[t]) + share[t] * x);
      prior = x > 0.0 ? c * std::pow(e / x, d) : std::pow(e, d);
    }
    out[i] = clamp01(l0[s] + l1[s] * (c - start[s]) + share[s] * prior);
  }
  return abi::ok();
}

}  // extern "C"
