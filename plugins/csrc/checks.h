// Argument checks of the C ABI, shared by the host and CUDA entry points. Scalar checks run for both; checks
// that read array contents run on the host path only (device arrays are not read back).
#pragma once

#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <string>

#include "echo/echo_abi.h"

namespace echo {
namespace abi {

inline std::string& last_error() {
  thread_local std::string message;
  return message;
}

inline int fail(const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  last_error() = buf;
  return ECHO_INVALID_ARGUMENT;
}

inline int ok() {
  last_error().clear();
  return ECHO_OK;
}

#define ECHO_REQUIRE(cond, ...)            \
  do {                                     \
    if (!(cond)) return ::echo::abi::fail(__VA_ARGS__); \
  } while (0)

inline int check_gate_scalars(const void* probs, const void* req, const void* active, int32_t m, int32_t b, float tau,
                              const void* conf, const void* passed) {
  ECHO_REQUIRE(b >= 0, "gate: batch_size must be >= 0, got %d", b);
  ECHO_REQUIRE(m >= 0, "gate: num_level_nodes must be >= 0, got %d", m);
  ECHO_REQUIRE(b > 0 || m == 0, "gate: a batch of 0 requests has no level nodes, got num_level_nodes = %d", m);
  ECHO_REQUIRE(!std::isnan(tau) && tau >= 0.0f && tau <= 1.0f, "gate: tau must be in [0, 1], got %g", tau);
  ECHO_REQUIRE(b == 0 || (active && conf && passed && (m == 0 || (probs && req))),
               "gate: a required array is NULL (path_probs, request_ids, active, confidence, passed)");
  return ECHO_OK;
}

inline int check_gate_data(const float* probs, const int32_t* req, int32_t m, int32_t b) {
  for (int32_t i = 0; i < m; ++i) {
    ECHO_REQUIRE(req[i] >= 0 && req[i] < b, "gate: request_ids[%d] = %d is outside [0, %d)", i, req[i], b);
    ECHO_REQUIRE(probs[i] >= 0.0f && probs[i] <= 1.0f, "gate: path_probs[%d] = %g is not a probability in [0, 1]",
                 i, probs[i]);
  }
  return ECHO_OK;
}

// A batch of 0 requests (TensorRT-LLM's generation inputs allow it) has 0 nodes: the entry points then write
// their trivial outputs (cu_out = [0], order_len = 0) and launch nothing.
inline int check_tree_scalars(const char* fn, int32_t b, int32_t n) {
  ECHO_REQUIRE(b >= 0, "%s: batch_size must be >= 0, got %d", fn, b);
  ECHO_REQUIRE(b > 0 || n == 0, "%s: a batch of 0 requests has 0 nodes, got num_nodes = %d", fn, n);
  ECHO_REQUIRE(n >= b, "%s: num_nodes (%d) must be >= batch_size (%d): every request has its root", fn, n, b);
  return ECHO_OK;
}

// What a batch of 0 requests must still pass: the one output each entry point writes.
inline int check_empty_allocation(const void* order_len) {
  ECHO_REQUIRE(order_len, "allocate_budget: order_len is NULL");
  return ECHO_OK;
}

inline int check_empty_pack(const void* cu_out, int32_t num_selected) {
  ECHO_REQUIRE(cu_out && num_selected == 0, "pack: a batch of 0 requests needs cu_out (1 entry) and num_selected 0");
  return ECHO_OK;
}

// cu[0] = 0, cu[B] = N, every request non-empty with its root first, parents within the request and before
// the child, depths (if given) consistent with the parents and below 65536.
inline int check_tree_data(const char* fn, const int32_t* cu, const int32_t* parents, const int32_t* depths, int32_t b,
                           int32_t n) {
  ECHO_REQUIRE(cu[0] == 0 && cu[b] == n, "%s: cu must start at 0 and end at num_nodes (%d), got cu[0]=%d cu[B]=%d",
               fn, n, cu[0], cu[b]);
  for (int32_t r = 0; r < b; ++r) {
    ECHO_REQUIRE(cu[r + 1] > cu[r], "%s: request %d has no nodes (cu must be strictly increasing)", fn, r);
    for (int32_t i = cu[r]; i < cu[r + 1]; ++i) {
      const int32_t local = i - cu[r], p = parents[i];
      if (local == 0) {
        ECHO_REQUIRE(p == -1, "%s: node %d is request %d's first node and must be its root (parent -1), got %d", fn,
                     i, r, p);
      } else {
        ECHO_REQUIRE(p >= 0 && p < local, "%s: node %d has parent %d; a parent must be an earlier node of the same "
                     "request (0 <= parent < %d)", fn, i, p, local);
      }
      if (depths) {
        const int32_t want = local == 0 ? 0 : depths[cu[r] + p] + 1;
        ECHO_REQUIRE(depths[i] == want, "%s: depths[%d] = %d but its parent chain gives %d", fn, i, depths[i], want);
        ECHO_REQUIRE(depths[i] <= 65535, "%s: depth %d of node %d exceeds 65535", fn, depths[i], i);
      }
    }
  }
  return ECHO_OK;
}

}  // namespace abi
}  // namespace echo
