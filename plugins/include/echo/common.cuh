// ECHO plugin: shared definitions. Every function marked ECHO_HD is the single source of a piece of logic
// that runs both in CUDA kernels and in the host reference path (compiled by nvcc or by a plain C++ compiler).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ECHO_HD __host__ __device__ __forceinline__
#define ECHO_DEVICE_BUILD 1
#else
#define ECHO_HD inline
#endif

namespace echo {

// Node indices are int32 (TensorRT-LLM's index type); a batch holds fewer than 2^31 nodes.
using index_t = int32_t;

constexpr uint32_t kLargestFiniteFloatBits = 0x7F7FFFFFu;
constexpr int kMaxDepth = 65535;  // depths must fit the 16 tie-break bits of the priority key
constexpr index_t kNoCap = 0x7FFFFFFF;

// Bit pattern of a float; monotone in the value for x >= 0 (probabilities).
ECHO_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

// Ordering bits of a probability: the float's bits for p > 0, else 0. -0.0 orders as +0.0 (as the core's torch
// sort and max treat them), and a NaN or a negative value, which the host entry points reject, orders as 0 on
// the device (whose arrays are not read back to check) instead of above every probability, as its raw bits would.
// Host and device use this one function, so they order every input identically.
ECHO_HD uint32_t prob_bits(float p) { return p > 0.0f ? float_bits(p) : 0u; }

// Priority of a candidate: path probability descending, then depth ascending; a stable sort of this key
// also orders equal keys by node index ascending. A child never outranks its parent (its probability is a
// product of factors <= 1, and on ties the shallower node wins), so every prefix is ancestor-closed.
ECHO_HD uint64_t priority_key(float path_prob, index_t depth) {
  return (static_cast<uint64_t>(kLargestFiniteFloatBits - prob_bits(path_prob)) << 16) |
         static_cast<uint64_t>(depth & 0xFFFF);
}

// Request of flat node `node` given cu (B+1,), cu[0] = 0: the r with cu[r] <= node < cu[r+1].
ECHO_HD index_t request_of(const index_t* cu, index_t batch_size, index_t node) {
  index_t lo = 0, hi = batch_size;  // invariant: cu[lo] <= node < cu[hi]
  while (hi - lo > 1) {
    index_t mid = (lo + hi) / 2;
    if (cu[mid] <= node) lo = mid; else hi = mid;
  }
  return lo;
}

// Depth of local node `local` of a request whose parents (local indices, -1 at the root) start at `parents`.
ECHO_HD index_t node_depth(const index_t* parents, index_t local) {
  index_t depth = 0;
  for (index_t p = parents[local]; p >= 0; p = parents[p]) ++depth;
  return depth;
}

// Is (prob_a, a) a better spine end than (prob_b, b)? Higher probability, then lower index.
ECHO_HD bool better_node(float prob_a, index_t a, float prob_b, index_t b) {
  const uint32_t x = prob_bits(prob_a), y = prob_bits(prob_b);  // -0.0 ties with +0.0, NaN never wins
  return x > y || (x == y && a < b);
}

// One 32-bit word of node `local`'s packed-mask row: bit (n - 32 * word) set for every n in {local and
// its ancestors} with n / 32 == word. Returned as the int32 TensorRT-LLM stores (bit 31 = sign bit).
ECHO_HD int32_t mask_word(const index_t* parents, index_t local, index_t word) {
  uint32_t bits = 0;
  for (index_t n = local; n >= 0; n = parents[n]) {
    if (n / 32 == word) bits |= 1u << (n % 32);
  }
  return static_cast<int32_t>(bits);
}

}  // namespace echo
