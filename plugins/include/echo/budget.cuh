// Elastic budget allocation over the whole Super-Tree (mirrors echo_trtllm.core.budget.allocate_budget):
//   roots (B of the budget), then priority 1 (every request's spine: its best node at its spine depth and
//   that node's ancestors), then priority 2 (every other non-root candidate), each phase taking candidates
//   in priority order while the global budget and the per-request cap (max_nodes_per_request - 1) allow.
//
// Data-parallel formulation, identical on host and device (only the primitives differ: std::stable_sort and
// a loop on the host, cub radix sort and scan on the device):
//   1. key[i] = priority_key(p_i, d_i); stable sort -> `order` (priority order of all nodes)
//   2. spine ends (one request per thread) and spine marks (walk to the root)
//   3. per phase: candidates in priority order are grouped by request (sort of (request << 32 | position));
//      rank within request = grouped position - segment start; eligible = rank < cap;
//      exclusive scan of eligible in priority order = the node's place among eligible ones;
//      taken = eligible && place < remaining. Place is also its slot in the output `order`.
#pragma once

#include <algorithm>
#include <numeric>
#include <vector>

#include "echo/common.cuh"

namespace echo {

struct TreeView {
  const float* path_probs;  // (N,) draft probability of the root path of each node
  const index_t* depths;    // (N,) root 0
  const index_t* parents;   // (N,) parent within the request, -1 at the root; parent < child
  const index_t* cu;        // (B+1,) request-major node offsets
  index_t batch_size;       // B
  index_t num_nodes;        // N
};

struct AllocationOut {
  uint8_t* selected;   // (N,) 1 = verified
  int8_t* phase;       // (N,) 0 root, 1 priority-1 depth, 2 priority-2 width, -1 not selected
  index_t* num_nodes;  // (B,) K_i, root included
  index_t* order;      // (N - B,) taken non-root nodes in the order taken; first *order_len valid
  index_t* order_len;  // (1,)
};

struct AllocationArgs {
  TreeView tree;
  const index_t* spine_depth;  // (B,) deepest gate depth passed, 0 = no spine
  index_t budget;              // K_max >= B
  index_t max_nodes_per_request;  // <= 0: no per-request cap
  AllocationOut out;
};

// Scratch arrays, each of N (node-sized) or B (request-sized) entries.
struct AllocationScratch {
  uint64_t* keys;        // N
  index_t* order;        // N: nodes in priority order
  index_t* request;      // N: request of each node
  index_t* spine_end;    // B
  uint8_t* spine;        // N
  uint8_t* candidate;    // N, by priority position
  uint64_t* group_keys;  // N
  index_t* grouped;      // N: priority positions grouped by request
  index_t* seg_count;    // B
  index_t* seg_start;    // B
  index_t* cap;          // B
  index_t* eligible;     // N, by priority position
  index_t* place;        // N, exclusive scan of eligible
  index_t* taken;        // B, nodes taken per request in the current phase
  index_t* remaining;    // 1
  index_t* written;      // 1: entries of out.order written so far
};

// ---- element operations (one thread each on the device) ------------------------------------------------

ECHO_HD void init_node(const AllocationArgs& a, const AllocationScratch& s, index_t i) {
  const bool root = a.tree.depths[i] == 0;
  a.out.selected[i] = root ? 1 : 0;
  a.out.phase[i] = root ? 0 : -1;
  s.keys[i] = priority_key(a.tree.path_probs[i], a.tree.depths[i]);
  s.order[i] = i;
  s.spine[i] = 0;
  s.request[i] = request_of(a.tree.cu, a.tree.batch_size, i);
}

ECHO_HD void init_request(const AllocationArgs& a, const AllocationScratch& s, index_t r) {
  s.cap[r] = a.max_nodes_per_request > 0 ? a.max_nodes_per_request - 1 : kNoCap;
  a.out.num_nodes[r] = 1;
  index_t best = -1;
  const index_t want = a.spine_depth[r];
  if (want > 0) {
    for (index_t n = a.tree.cu[r]; n < a.tree.cu[r + 1]; ++n) {
      if (a.tree.depths[n] == want && (best < 0 || better_node(a.tree.path_probs[n], n, a.tree.path_probs[best], best)))
        best = n;
    }
  }
  s.spine_end[r] = best;
}

ECHO_HD void mark_spine(const AllocationArgs& a, const AllocationScratch& s, index_t r) {
  const index_t base = a.tree.cu[r];
  for (index_t n = s.spine_end[r]; n >= 0 && a.tree.depths[n] > 0;) {
    s.spine[n] = 1;
    n = a.tree.parents[n] >= 0 ? base + a.tree.parents[n] : -1;
  }
}

ECHO_HD bool is_candidate(const AllocationArgs& a, const AllocationScratch& s, int phase, index_t n) {
  return phase == 1 ? s.spine[n] != 0 : (a.tree.depths[n] > 0 && a.out.phase[n] != 1);
}

// j: priority position. Non-candidates sort after every request's candidates (request key B).
ECHO_HD void group_key(const AllocationArgs& a, const AllocationScratch& s, int phase, index_t j) {
  const index_t n = s.order[j];
  const bool c = is_candidate(a, s, phase, n);
  s.candidate[j] = c ? 1 : 0;
  const uint64_t seg = c ? static_cast<uint64_t>(s.request[n]) : static_cast<uint64_t>(a.tree.batch_size);
  s.group_keys[j] = (seg << 32) | static_cast<uint64_t>(j);
  s.grouped[j] = j;
}

// g: grouped position; the rank of its node among its request's candidates is g - seg_start.
ECHO_HD void rank_eligible(const AllocationScratch& s, index_t g) {
  const index_t j = s.grouped[g];
  if (!s.candidate[j]) {
    s.eligible[j] = 0;
    return;
  }
  const index_t r = s.request[s.order[j]];
  s.eligible[j] = (g - s.seg_start[r]) < s.cap[r] ? 1 : 0;
}

// Returns whether priority position j is taken in this phase (the caller counts it for its request).
ECHO_HD bool take(const AllocationArgs& a, const AllocationScratch& s, int phase, index_t j, index_t remaining,
                  index_t written) {
  if (!s.eligible[j] || s.place[j] >= remaining) return false;
  const index_t n = s.order[j];
  a.out.selected[n] = 1;
  a.out.phase[n] = static_cast<int8_t>(phase);
  a.out.order[written + s.place[j]] = n;
  return true;
}

// After a phase (one thread): the phase took min(remaining, eligible total) nodes.
ECHO_HD void finish_phase(const AllocationArgs& a, const AllocationScratch& s) {
  const index_t last = a.tree.num_nodes - 1;
  const index_t eligible_total = a.tree.num_nodes > 0 ? s.place[last] + s.eligible[last] : 0;
  const index_t took = eligible_total < *s.remaining ? eligible_total : *s.remaining;
  *s.remaining -= took;
  *s.written += took;
  *a.out.order_len = *s.written;
}

ECHO_HD void finish_request(const AllocationArgs& a, const AllocationScratch& s, index_t r) {
  a.out.num_nodes[r] += s.taken[r];
  s.cap[r] -= s.taken[r];
  s.taken[r] = 0;
  s.seg_count[r] = 0;
}

// ---- host path ------------------------------------------------------------------------------------------

namespace host {

struct HostScratch {
  std::vector<uint64_t> keys, group_keys;
  std::vector<index_t> order, request, spine_end, grouped, seg_count, seg_start, cap, eligible, place, taken;
  std::vector<uint8_t> spine, candidate;
  index_t remaining = 0, written = 0;
  AllocationScratch view;

  HostScratch(index_t n, index_t b)
      : keys(n), group_keys(n), order(n), request(n), spine_end(b), grouped(n), seg_count(b, 0), seg_start(b),
        cap(b), eligible(n), place(n), taken(b, 0), spine(n), candidate(n) {
    view = {keys.data(), order.data(), request.data(), spine_end.data(), spine.data(), candidate.data(),
            group_keys.data(), grouped.data(), seg_count.data(), seg_start.data(), cap.data(), eligible.data(),
            place.data(), taken.data(), &remaining, &written};
  }
};

// Stable sort of `vals` by `keys` (both length n), the host twin of cub::DeviceRadixSort::SortPairs.
inline void sort_pairs(uint64_t* keys, index_t* vals, index_t n) {
  std::vector<index_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](index_t x, index_t y) { return keys[x] < keys[y]; });
  std::vector<uint64_t> k(n);
  std::vector<index_t> v(n);
  for (index_t i = 0; i < n; ++i) {
    k[i] = keys[idx[i]];
    v[i] = vals[idx[i]];
  }
  std::copy(k.begin(), k.end(), keys);
  std::copy(v.begin(), v.end(), vals);
}

inline void exclusive_scan(const index_t* in, index_t* out, index_t n) {
  index_t acc = 0;
  for (index_t i = 0; i < n; ++i) {
    out[i] = acc;
    acc += in[i];
  }
}

inline void allocate_budget(const AllocationArgs& a) {
  const index_t n = a.tree.num_nodes, b = a.tree.batch_size;
  HostScratch hs(n, b);
  const AllocationScratch& s = hs.view;
  for (index_t i = 0; i < n; ++i) init_node(a, s, i);
  for (index_t r = 0; r < b; ++r) init_request(a, s, r);
  for (index_t r = 0; r < b; ++r) mark_spine(a, s, r);
  sort_pairs(s.keys, s.order, n);
  hs.remaining = a.budget - b;
  hs.written = 0;
  *a.out.order_len = 0;
  for (int phase = 1; phase <= 2; ++phase) {
    for (index_t j = 0; j < n; ++j) group_key(a, s, phase, j);
    sort_pairs(s.group_keys, s.grouped, n);
    for (index_t j = 0; j < n; ++j)
      if (s.candidate[j]) ++s.seg_count[s.request[s.order[j]]];
    exclusive_scan(s.seg_count, s.seg_start, b);
    for (index_t g = 0; g < n; ++g) rank_eligible(s, g);
    exclusive_scan(s.eligible, s.place, n);
    const index_t remaining = hs.remaining, written = hs.written;
    for (index_t j = 0; j < n; ++j)
      if (take(a, s, phase, j, remaining, written)) ++s.taken[s.request[s.order[j]]];
    finish_phase(a, s);
    for (index_t r = 0; r < b; ++r) finish_request(a, s, r);
  }
}

}  // namespace host
}  // namespace echo

#if defined(ECHO_DEVICE_BUILD)
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

namespace echo {
namespace cuda {

namespace detail {

constexpr size_t kAlign = 256;

struct Carver {
  char* base;
  size_t used = 0;
  template <typename T>
  T* take(size_t count) {
    used = (used + kAlign - 1) / kAlign * kAlign;
    T* p = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += count * sizeof(T);
    return p;
  }
};

struct DeviceScratch {
  AllocationScratch s;
  uint64_t* keys_alt;
  index_t* order_alt;
  index_t* grouped_alt;
  void* cub_temp;
  size_t cub_bytes;
};

inline int bits_for(index_t value) {
  int bits = 1;
  while (bits < 31 && (index_t(1) << bits) <= value) ++bits;
  return bits;
}

inline cudaError_t cub_bytes(index_t n, index_t b, size_t* bytes) {
  size_t sort = 0, scan_n = 0, scan_b = 0;
  cub::DoubleBuffer<uint64_t> k(nullptr, nullptr);
  cub::DoubleBuffer<index_t> v(nullptr, nullptr);
  cudaError_t err = cub::DeviceRadixSort::SortPairs(nullptr, sort, k, v, n);
  if (err != cudaSuccess) return err;
  err = cub::DeviceScan::ExclusiveSum(nullptr, scan_n, static_cast<index_t*>(nullptr), static_cast<index_t*>(nullptr), n);
  if (err != cudaSuccess) return err;
  err = cub::DeviceScan::ExclusiveSum(nullptr, scan_b, static_cast<index_t*>(nullptr), static_cast<index_t*>(nullptr), b);
  *bytes = sort > scan_n ? (sort > scan_b ? sort : scan_b) : (scan_n > scan_b ? scan_n : scan_b);
  return err;
}

inline cudaError_t carve(void* workspace, index_t n, index_t b, DeviceScratch* d, size_t* total) {
  Carver c{static_cast<char*>(workspace)};
  AllocationScratch& s = d->s;
  s.keys = c.take<uint64_t>(n);
  s.group_keys = c.take<uint64_t>(n);
  d->keys_alt = c.take<uint64_t>(n);
  s.order = c.take<index_t>(n);
  d->order_alt = c.take<index_t>(n);
  s.grouped = c.take<index_t>(n);
  d->grouped_alt = c.take<index_t>(n);
  s.request = c.take<index_t>(n);
  s.eligible = c.take<index_t>(n);
  s.place = c.take<index_t>(n);
  s.spine = c.take<uint8_t>(n);
  s.candidate = c.take<uint8_t>(n);
  s.spine_end = c.take<index_t>(b);
  s.seg_count = c.take<index_t>(b);
  s.seg_start = c.take<index_t>(b);
  s.cap = c.take<index_t>(b);
  s.taken = c.take<index_t>(b);
  s.remaining = c.take<index_t>(1);
  s.written = c.take<index_t>(1);
  cudaError_t err = cub_bytes(n, b, &d->cub_bytes);
  d->cub_temp = c.take<char>(d->cub_bytes);
  *total = c.used;
  return err;
}

__global__ void init_node_kernel(AllocationArgs a, AllocationScratch s) {
  index_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < a.tree.num_nodes) init_node(a, s, i);
}

__global__ void init_request_kernel(AllocationArgs a, AllocationScratch s) {
  index_t r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < a.tree.batch_size) {
    init_request(a, s, r);
    s.seg_count[r] = 0;
    s.taken[r] = 0;
  }
  if (r == 0) {
    *s.remaining = a.budget - a.tree.batch_size;
    *s.written = 0;
    *a.out.order_len = 0;
  }
}

// After init_request_kernel: spine ends are known for every request.
__global__ void mark_spine_kernel(AllocationArgs a, AllocationScratch s) {
  index_t r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < a.tree.batch_size) mark_spine(a, s, r);
}

__global__ void group_key_kernel(AllocationArgs a, AllocationScratch s, int phase) {
  index_t j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j < a.tree.num_nodes) {
    group_key(a, s, phase, j);
    if (s.candidate[j]) atomicAdd(&s.seg_count[s.request[s.order[j]]], 1);
  }
}

__global__ void rank_kernel(AllocationArgs a, AllocationScratch s) {
  index_t g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g < a.tree.num_nodes) rank_eligible(s, g);
}

__global__ void take_kernel(AllocationArgs a, AllocationScratch s, int phase) {
  index_t j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j < a.tree.num_nodes && take(a, s, phase, j, *s.remaining, *s.written))
    atomicAdd(&s.taken[s.request[s.order[j]]], 1);
}

__global__ void finish_phase_kernel(AllocationArgs a, AllocationScratch s) { finish_phase(a, s); }

__global__ void finish_request_kernel(AllocationArgs a, AllocationScratch s) {
  index_t r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < a.tree.batch_size) finish_request(a, s, r);
}

}  // namespace detail

// Bytes of device workspace `allocate_budget` needs for n nodes and b requests.
inline cudaError_t allocation_workspace_bytes(index_t n, index_t b, size_t* bytes) {
  detail::DeviceScratch d{};
  return detail::carve(nullptr, n, b, &d, bytes);
}

// Asynchronous on `stream`; every pointer is device memory. Arguments are checked by the C ABI.
inline cudaError_t allocate_budget(const AllocationArgs& a, void* workspace, size_t workspace_bytes,
                                   cudaStream_t stream) {
  const index_t n = a.tree.num_nodes, b = a.tree.batch_size;
  detail::DeviceScratch d{};
  size_t need = 0;
  cudaError_t err = detail::carve(workspace, n, b, &d, &need);
  if (err != cudaSuccess) return err;
  if (workspace_bytes < need) return cudaErrorInvalidValue;
  AllocationScratch s = d.s;
  constexpr int kThreads = 256;
  const int nb = (n + kThreads - 1) / kThreads, bb = (b + kThreads - 1) / kThreads;
  detail::init_node_kernel<<<nb, kThreads, 0, stream>>>(a, s);
  detail::init_request_kernel<<<bb, kThreads, 0, stream>>>(a, s);
  detail::mark_spine_kernel<<<bb, kThreads, 0, stream>>>(a, s);
  {
    cub::DoubleBuffer<uint64_t> keys(s.keys, d.keys_alt);
    cub::DoubleBuffer<index_t> vals(s.order, d.order_alt);
    err = cub::DeviceRadixSort::SortPairs(d.cub_temp, d.cub_bytes, keys, vals, n, 0, 48, stream);
    if (err != cudaSuccess) return err;
    s.order = vals.Current();
  }
  const int group_bits = 32 + detail::bits_for(b + 1);
  for (int phase = 1; phase <= 2; ++phase) {
    detail::group_key_kernel<<<nb, kThreads, 0, stream>>>(a, s, phase);
    cub::DoubleBuffer<uint64_t> keys(s.group_keys, d.keys_alt);
    cub::DoubleBuffer<index_t> vals(d.s.grouped, d.grouped_alt);
    err = cub::DeviceRadixSort::SortPairs(d.cub_temp, d.cub_bytes, keys, vals, n, 0, group_bits, stream);
    if (err != cudaSuccess) return err;
    AllocationScratch sp = s;
    sp.grouped = vals.Current();
    err = cub::DeviceScan::ExclusiveSum(d.cub_temp, d.cub_bytes, sp.seg_count, sp.seg_start, b, stream);
    if (err != cudaSuccess) return err;
    detail::rank_kernel<<<nb, kThreads, 0, stream>>>(a, sp);
    err = cub::DeviceScan::ExclusiveSum(d.cub_temp, d.cub_bytes, sp.eligible, sp.place, n, stream);
    if (err != cudaSuccess) return err;
    detail::take_kernel<<<nb, kThreads, 0, stream>>>(a, sp, phase);
    detail::finish_phase_kernel<<<1, 1, 0, stream>>>(a, sp);
    detail::finish_request_kernel<<<bb, kThreads, 0, stream>>>(a, sp);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace echo
#endif
