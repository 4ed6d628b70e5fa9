// C ABI, CUDA entry points: scalar argument checks, then the kernels enqueued on the caller's stream.
// Array contents live on the device and are not read back; the host entry points check them.
#include <cuda_runtime.h>

#include "checks.h"
#include "echo/budget.cuh"
#include "echo/gate.cuh"
#include "echo/pack.cuh"

using echo::index_t;
namespace abi = echo::abi;

namespace {

int cuda_status(cudaError_t err, const char* fn) {
  if (err == cudaSuccess) return abi::ok();
  abi::last_error() = std::string(fn) + ": CUDA error: " + cudaGetErrorString(err);
  return ECHO_CUDA_ERROR;
}

size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

extern "C" {

int echo_has_cuda(void) { return 1; }

int echo_gate_cuda(const float* path_probs, const int32_t* request_ids, const uint8_t* active,
                   int32_t num_level_nodes, int32_t batch_size, float tau, float* confidence, uint8_t* passed,
                   void* stream) {
  if (int rc = abi::check_gate_scalars(path_probs, request_ids, active, num_level_nodes, batch_size, tau, confidence,
                                       passed))
    return rc;
  if (batch_size == 0) return abi::ok();
  return cuda_status(echo::cuda::gate({path_probs, request_ids, active, num_level_nodes, batch_size, tau, confidence,
                                       passed},
                                      static_cast<cudaStream_t>(stream)),
                     "gate");
}

int echo_allocate_budget_workspace_bytes(int32_t num_nodes, int32_t batch_size, size_t* bytes) {
  if (int rc = abi::check_tree_scalars("allocate_budget_workspace_bytes", batch_size, num_nodes)) return rc;
  ECHO_REQUIRE(bytes, "allocate_budget_workspace_bytes: bytes is NULL");
  if (batch_size == 0) {
    *bytes = 0;
    return abi::ok();
  }
  return cuda_status(echo::cuda::allocation_workspace_bytes(num_nodes, batch_size, bytes), "allocate_budget");
}

int echo_allocate_budget_cuda(const float* path_probs, const int32_t* depths, const int32_t* parents,
                              const int32_t* cu, int32_t batch_size, int32_t num_nodes, const int32_t* spine_depth,
                              int32_t budget, int32_t max_nodes_per_request, uint8_t* selected, int8_t* phase,
                              int32_t* num_nodes_out, int32_t* order, int32_t* order_len, void* workspace,
                              size_t workspace_bytes, void* stream) {
  if (int rc = abi::check_tree_scalars("allocate_budget", batch_size, num_nodes)) return rc;
  if (batch_size == 0) {  // nothing to allocate: order_len = 0, written on the stream like every output
    if (int rc = abi::check_empty_allocation(order_len)) return rc;
    return cuda_status(cudaMemsetAsync(order_len, 0, sizeof(int32_t), static_cast<cudaStream_t>(stream)),
                       "allocate_budget");
  }
  ECHO_REQUIRE(path_probs && depths && parents && cu && spine_depth && selected && phase && num_nodes_out &&
                   order_len && workspace,
               "allocate_budget: a required array (or the workspace) is NULL");
  ECHO_REQUIRE(order || num_nodes <= echo::kFusedMaxNodes || num_nodes == batch_size,
               "allocate_budget: order may be NULL (the fused path) only for num_nodes <= %d (or roots only), got %d",
               echo::kFusedMaxNodes, num_nodes);
  ECHO_REQUIRE(budget >= batch_size,
               "allocate_budget: budget K_max = %d is below the batch size %d: every request needs its root", budget,
               batch_size);
  size_t need = 0;
  if (int rc = cuda_status(echo::cuda::allocation_workspace_bytes(num_nodes, batch_size, &need), "allocate_budget"))
    return rc;
  ECHO_REQUIRE(workspace_bytes >= need, "allocate_budget: workspace has %zu bytes, needs %zu "
               "(echo_allocate_budget_workspace_bytes)", workspace_bytes, need);
  echo::AllocationArgs a{{path_probs, depths, parents, cu, batch_size, num_nodes},
                         spine_depth,
                         budget,
                         max_nodes_per_request,
                         {selected, phase, num_nodes_out, order, order_len}};
  return cuda_status(echo::cuda::allocate_budget(a, workspace, workspace_bytes, static_cast<cudaStream_t>(stream)),
                     "allocate_budget");
}

int echo_pack_workspace_bytes(int32_t num_nodes, size_t* bytes) {
  ECHO_REQUIRE(num_nodes >= 0 && bytes, "pack_workspace_bytes: num_nodes must be >= 0 and bytes non-NULL");
  if (num_nodes == 0) {
    *bytes = 0;
    return abi::ok();
  }
  size_t inner = 0;
  if (int rc = cuda_status(echo::cuda::pack_workspace_bytes(num_nodes, &inner), "pack")) return rc;
  *bytes = align_up(static_cast<size_t>(num_nodes) * sizeof(index_t)) + inner;
  return ECHO_OK;
}

int echo_pack_cuda(const int32_t* parents, const int32_t* cu, const uint8_t* selected, const int32_t* context_lengths,
                   int32_t batch_size, int32_t num_nodes, int32_t num_selected, int32_t n_max, int32_t* cu_out,
                   int32_t* generation_lengths, int32_t* src_index, int32_t* parents_out, int32_t* depths_out,
                   int32_t* position_ids, int32_t* position_offsets, int32_t* packed_mask, void* workspace,
                   size_t workspace_bytes, void* stream) {
  if (int rc = abi::check_tree_scalars("pack", batch_size, num_nodes)) return rc;
  if (batch_size == 0) {  // cu_out = [0], written on the stream
    if (int rc = abi::check_empty_pack(cu_out, num_selected)) return rc;
    return cuda_status(cudaMemsetAsync(cu_out, 0, sizeof(int32_t), static_cast<cudaStream_t>(stream)), "pack");
  }
  ECHO_REQUIRE(parents && cu && cu_out && generation_lengths && src_index && parents_out && depths_out &&
                   position_ids && position_offsets && packed_mask && workspace,
               "pack: a required array (or the workspace) is NULL");
  ECHO_REQUIRE(n_max >= 1, "pack: n_max must be >= 1, got %d", n_max);
  ECHO_REQUIRE(num_selected >= batch_size && num_selected <= num_nodes,
               "pack: num_selected (rows available, >= K) must lie in [batch_size, num_nodes] = [%d, %d], got %d",
               batch_size, num_nodes, num_selected);
  size_t need = 0;
  if (int rc = echo_pack_workspace_bytes(num_nodes, &need)) return rc;
  ECHO_REQUIRE(workspace_bytes >= need, "pack: workspace has %zu bytes, needs %zu (echo_pack_workspace_bytes)",
               workspace_bytes, need);
  const size_t head = align_up(static_cast<size_t>(num_nodes) * sizeof(index_t));
  echo::PackArgs a{parents,      cu,          selected,     context_lengths,  batch_size, num_nodes,
                   num_selected, n_max,       static_cast<index_t*>(workspace), cu_out, generation_lengths, src_index,
                   parents_out,  depths_out,  position_ids, position_offsets, packed_mask};
  return cuda_status(echo::cuda::pack(a, static_cast<char*>(workspace) + head, workspace_bytes - head,
                                      static_cast<cudaStream_t>(stream)),
                     "pack");
}

}  // extern "C"
