// Sparse confidence gate at one draft level: c_i = the largest path probability among request i's nodes of
// the level (0 where it has none), passed_i = active_i && c_i > tau. Mirrors echo_trtllm.core.gating.
#pragma once

#include "echo/common.cuh"

namespace echo {

struct GateArgs {
  const float* path_probs;     // (M,) path probability of each node of the level
  const index_t* request_ids;  // (M,) request of each node, in [0, B)
  const uint8_t* active;       // (B,) requests still drafting
  index_t num_level_nodes;     // M
  index_t batch_size;          // B
  float tau;                   // the level's threshold
  float* confidence;           // (B,) out
  uint8_t* passed;             // (B,) out
};

ECHO_HD void gate_decide(const GateArgs& a, index_t i) {
  a.passed[i] = (a.active[i] != 0 && a.confidence[i] > a.tau) ? 1 : 0;
}

namespace host {

inline void gate(const GateArgs& a) {
  for (index_t i = 0; i < a.batch_size; ++i) a.confidence[i] = 0.0f;
  for (index_t m = 0; m < a.num_level_nodes; ++m) {
    float& c = a.confidence[a.request_ids[m]];
    if (prob_bits(a.path_probs[m]) > prob_bits(c)) c = a.path_probs[m];  // the device's max, on the same bits
  }
  for (index_t i = 0; i < a.batch_size; ++i) gate_decide(a, i);
}

}  // namespace host

#if defined(ECHO_DEVICE_BUILD)
namespace cuda {

__global__ void gate_zero_kernel(GateArgs a) {
  index_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < a.batch_size) a.confidence[i] = 0.0f;
}

// prob_bits of probabilities order like their values: an unsigned atomicMax on them is a float max (-0.0 and NaN
// map to the bits of +0.0, as on the host).
__global__ void gate_max_kernel(GateArgs a) {
  index_t m = blockIdx.x * blockDim.x + threadIdx.x;
  if (m < a.num_level_nodes) {
    atomicMax(reinterpret_cast<unsigned int*>(a.confidence) + a.request_ids[m], prob_bits(a.path_probs[m]));
  }
}

__global__ void gate_decide_kernel(GateArgs a) {
  index_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < a.batch_size) gate_decide(a, i);
}

inline cudaError_t gate(const GateArgs& a, cudaStream_t stream) {
  constexpr int kThreads = 256;
  int b_blocks = (a.batch_size + kThreads - 1) / kThreads;
  gate_zero_kernel<<<b_blocks, kThreads, 0, stream>>>(a);
  if (a.num_level_nodes > 0) {
    gate_max_kernel<<<(a.num_level_nodes + kThreads - 1) / kThreads, kThreads, 0, stream>>>(a);
  }
  gate_decide_kernel<<<b_blocks, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace cuda
#endif

}  // namespace echo
