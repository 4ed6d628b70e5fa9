// Select & pack: the verified sub-tree of the Super-Tree in TensorRT-LLM's tree-attention layout (mirrors
// echo_trtllm.core: SuperTree.select followed by pack):
//   generation_lengths [B]            int32  K_i
//   position_offsets   [B, n_max]     int32  depth of node j of request i, 0-padded
//   packed_mask        [K, W]         int32  row k: bit b of word w <=> node k attends node 32w+b of its request
// plus the runtime's index arrays: cu_out [B+1], src_index [K] (the tree node each row came from),
// parents_out [K] (within the request), depths_out [K], position_ids [K] = context length + depth.
// W = ceil(n_max / 32); n_max may exceed max_i K_i (the extra columns and words are zero).
#pragma once

#include "echo/common.cuh"

namespace echo {

struct PackArgs {
  const index_t* parents;          // (N,) within-request parents of the full tree
  const index_t* cu;               // (B+1,)
  const uint8_t* selected;         // (N,) rows to keep (roots and ancestor-closed), or nullptr for all
  const index_t* context_lengths;  // (B,) or nullptr (positions are then the depths)
  index_t batch_size;              // B
  index_t num_nodes;               // N
  index_t num_selected;            // K on the host path; on the device, rows available (>= K; K is computed)
  index_t n_max;                   // >= max_i K_i
  index_t* new_index;              // (N,) scratch/out: exclusive scan of selected
  index_t* cu_out;                 // (B+1,)
  index_t* generation_lengths;     // (B,)
  index_t* src_index;              // (K,)
  index_t* parents_out;            // (K,)
  index_t* depths_out;             // (K,)
  index_t* position_ids;           // (K,)
  index_t* position_offsets;       // (B, n_max)
  int32_t* packed_mask;            // (K, W)
};

ECHO_HD index_t words_per_row(index_t n_max) { return n_max > 0 ? (n_max + 31) / 32 : 1; }

ECHO_HD index_t is_selected(const PackArgs& a, index_t i) { return a.selected ? (a.selected[i] ? 1 : 0) : 1; }

// After new_index (exclusive scan of is_selected) is known. Roots are selected, so cu_out[r] = new_index[cu[r]].
ECHO_HD void select_node(const PackArgs& a, index_t i) {
  if (!is_selected(a, i)) return;
  const index_t r = request_of(a.cu, a.batch_size, i);
  const index_t k = a.new_index[i];
  if (k >= a.num_selected) return;  // capacity mode: more rows than the caller made room for; cu_out[B] says K
  const index_t p = a.parents[i];
  a.src_index[k] = i;
  a.parents_out[k] = p < 0 ? -1 : a.new_index[a.cu[r] + p] - a.new_index[a.cu[r]];
}

// K, known once new_index is: the exclusive scan's last entry plus the last node's own flag.
ECHO_HD index_t selected_total(const PackArgs& a) {
  return a.new_index[a.num_nodes - 1] + is_selected(a, a.num_nodes - 1);
}

ECHO_HD void request_bounds(const PackArgs& a, index_t r) {
  a.cu_out[r] = a.new_index[a.cu[r]];
  if (r == a.batch_size - 1) a.cu_out[a.batch_size] = selected_total(a);
}

ECHO_HD void request_length(const PackArgs& a, index_t r) { a.generation_lengths[r] = a.cu_out[r + 1] - a.cu_out[r]; }

ECHO_HD void node_position(const PackArgs& a, index_t k) {
  const index_t r = request_of(a.cu_out, a.batch_size, k);
  const index_t base = a.cu_out[r];
  const index_t d = node_depth(a.parents_out + base, k - base);
  a.depths_out[k] = d;
  a.position_ids[k] = (a.context_lengths ? a.context_lengths[r] : 0) + d;
}

ECHO_HD void mask_row_word(const PackArgs& a, index_t k, index_t w) {
  const index_t r = request_of(a.cu_out, a.batch_size, k);
  const index_t base = a.cu_out[r];
  a.packed_mask[static_cast<int64_t>(k) * words_per_row(a.n_max) + w] = mask_word(a.parents_out + base, k - base, w);
}

ECHO_HD void offset_entry(const PackArgs& a, index_t r, index_t j) {
  const index_t len = a.cu_out[r + 1] - a.cu_out[r];
  const bool written = j < len && a.cu_out[r] + j < a.num_selected;  // rows past the capacity were not written
  a.position_offsets[static_cast<int64_t>(r) * a.n_max + j] = written ? a.depths_out[a.cu_out[r] + j] : 0;
}

namespace host {

inline void pack(const PackArgs& a) {
  index_t acc = 0;
  for (index_t i = 0; i < a.num_nodes; ++i) {
    a.new_index[i] = acc;
    acc += is_selected(a, i);
  }
  for (index_t i = 0; i < a.num_nodes; ++i) select_node(a, i);
  for (index_t r = 0; r < a.batch_size; ++r) request_bounds(a, r);
  for (index_t r = 0; r < a.batch_size; ++r) request_length(a, r);
  for (index_t k = 0; k < a.num_selected; ++k) node_position(a, k);
  const index_t w = words_per_row(a.n_max);
  for (index_t k = 0; k < a.num_selected; ++k)
    for (index_t x = 0; x < w; ++x) mask_row_word(a, k, x);
  for (index_t r = 0; r < a.batch_size; ++r)
    for (index_t j = 0; j < a.n_max; ++j) offset_entry(a, r, j);
}

}  // namespace host

#if defined(ECHO_DEVICE_BUILD)
}  // namespace echo
#include <cub/device/device_scan.cuh>
namespace echo {
namespace cuda {
namespace detail {

__global__ void selected_flags_kernel(PackArgs a) {
  index_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < a.num_nodes) a.new_index[i] = is_selected(a, i);
}

__global__ void select_kernel(PackArgs a) {
  index_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < a.num_nodes) select_node(a, i);
}

__global__ void bounds_kernel(PackArgs a) {
  index_t r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < a.batch_size) request_bounds(a, r);
}

__global__ void lengths_kernel(PackArgs a) {
  index_t r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < a.batch_size) request_length(a, r);
}

__global__ void position_kernel(PackArgs a) {
  index_t k = blockIdx.x * blockDim.x + threadIdx.x;
  if (k < a.num_selected && k < a.cu_out[a.batch_size]) node_position(a, k);
}

__global__ void mask_kernel(PackArgs a) {
  const int64_t w = words_per_row(a.n_max);
  int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < static_cast<int64_t>(a.num_selected) * w && t / w < a.cu_out[a.batch_size])
    mask_row_word(a, static_cast<index_t>(t / w), static_cast<index_t>(t % w));
}

__global__ void offsets_kernel(PackArgs a) {
  int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < static_cast<int64_t>(a.batch_size) * a.n_max) offset_entry(a, static_cast<index_t>(t / a.n_max), static_cast<index_t>(t % a.n_max));
}

}  // namespace detail

// Workspace: selection flags (N int32), then the scan's temporary storage.
inline cudaError_t pack_workspace_bytes(index_t n, size_t* bytes) {
  size_t scan = 0;
  cudaError_t err =
      cub::DeviceScan::ExclusiveSum(nullptr, scan, static_cast<index_t*>(nullptr), static_cast<index_t*>(nullptr), n);
  *bytes = (static_cast<size_t>(n) * sizeof(index_t) + 255) / 256 * 256 + scan;
  return err;
}

// Asynchronous on `stream`; every pointer is device memory. Arguments are checked by the C ABI.
inline cudaError_t pack(const PackArgs& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  constexpr int kThreads = 256;
  auto blocks = [](int64_t count) { return static_cast<unsigned>((count + kThreads - 1) / kThreads); };
  size_t need = 0;
  cudaError_t err = pack_workspace_bytes(a.num_nodes, &need);
  if (err != cudaSuccess) return err;
  if (workspace_bytes < need) return cudaErrorInvalidValue;
  const size_t flag_bytes = (static_cast<size_t>(a.num_nodes) * sizeof(index_t) + 255) / 256 * 256;
  index_t* flags = static_cast<index_t*>(workspace);
  PackArgs f = a;
  f.new_index = flags;
  detail::selected_flags_kernel<<<blocks(a.num_nodes), kThreads, 0, stream>>>(f);
  size_t scan_bytes = need - flag_bytes;
  err = cub::DeviceScan::ExclusiveSum(static_cast<char*>(workspace) + flag_bytes, scan_bytes, flags, a.new_index,
                                      a.num_nodes, stream);
  if (err != cudaSuccess) return err;
  detail::select_kernel<<<blocks(a.num_nodes), kThreads, 0, stream>>>(a);
  detail::bounds_kernel<<<blocks(a.batch_size), kThreads, 0, stream>>>(a);
  detail::lengths_kernel<<<blocks(a.batch_size), kThreads, 0, stream>>>(a);
  detail::position_kernel<<<blocks(a.num_selected), kThreads, 0, stream>>>(a);
  detail::mask_kernel<<<blocks(static_cast<int64_t>(a.num_selected) * words_per_row(a.n_max)), kThreads, 0, stream>>>(a);
  detail::offsets_kernel<<<blocks(static_cast<int64_t>(a.batch_size) * a.n_max), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace cuda
#endif

}  // namespace echo
