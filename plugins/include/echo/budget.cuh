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
#include "echo/echo_abi.h"

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

// Request r's spine end: its best node at depth spine_depth[r] (-1: none, or no spine).
ECHO_HD index_t find_spine_end(const AllocationArgs& a, index_t r) {
  index_t best = -1;
  const index_t want = a.spine_depth[r];
  if (want > 0) {
    for (index_t n = a.tree.cu[r]; n < a.tree.cu[r + 1]; ++n) {
      if (a.tree.depths[n] == want && (best < 0 || better_node(a.tree.path_probs[n], n, a.tree.path_probs[best], best)))
        best = n;
    }
  }
  return best;
}

ECHO_HD index_t request_cap(const AllocationArgs& a) {
  return a.max_nodes_per_request > 0 ? a.max_nodes_per_request - 1 : kNoCap;
}

ECHO_HD void init_request(const AllocationArgs& a, const AllocationScratch& s, index_t r) {
  s.cap[r] = request_cap(a);
  a.out.num_nodes[r] = 1;
  s.spine_end[r] = find_spine_end(a, r);
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

namespace echo {

// ---- fused allocation -------------------------------------------------------------------------------------
// The same selection, phases, K_i and order_len (not the taken order) in three data-parallel steps, three kernels
// on the device, for N <= kFusedMaxNodes (a node's index then fits the low 16 bits of its composite key):
//   1. per request: roots and outputs initialised; the spine (its end and ancestors) sorted by key, each spine
//      node's rank among them, the ones ranked below the cap compacted in ascending key order at ekey1[cu[r] ..];
//      the request's nodes sorted by key (rsorted, the request's priority order)
//   2. the global cuts (one block on the device): T1 = the R-th smallest phase-1 eligible key (R = budget - B),
//      t1[r] = request r's eligible keys <= T1; phase-2 candidates (non-root, not taken in phase 1) ranked within
//      their request in priority order, those below cap - t1 compacted at ekey2; T2 = the R2-th smallest (R2 = R
//      minus phase 1's take), t2[r]
//   3. per node: taken in phase p iff phase-p eligible and its key <= T_p; K_i = 1 + t1 + t2.
// Taking "eligible candidates in priority order while the budget lasts" is taking the R smallest eligible keys;
// composite keys are unique (the node index breaks ties), so each phase's cut is one threshold: a radix select
// on the device, nth_element on the host.

constexpr index_t kFusedMaxNodes = ECHO_FUSED_ALLOCATION_MAX_NODES;  // echo_abi.h
constexpr uint64_t kNoKey = ~uint64_t(0);

// Priority order as one unique 64-bit key: priority_key (48 bits) then the node index (16 bits).
ECHO_HD uint64_t composite_key(const TreeView& t, index_t node) {
  return (priority_key(t.path_probs[node], t.depths[node]) << 16) | static_cast<uint64_t>(node & 0xFFFF);
}

ECHO_HD index_t key_node(uint64_t key) { return static_cast<index_t>(key & 0xFFFF); }

struct FusedScratch {
  uint64_t* sort;     // 2N: per-request sort buffers, request r's at 2 * cu[r] (a power of two >= its size)
  uint64_t* ekey1;    // N: phase-1 eligible keys of request r at cu[r] .., ascending, then kNoKey
  uint64_t* ekey2;    // N: the same for phase 2
  index_t* rsorted;   // N: the request-major priority order (node ids)
  index_t* rreq;      // N: request of each rsorted position
  index_t* rank1;     // N: node -> rank among its request's spine nodes (-1: not a spine node)
  index_t* rank2;     // N: node -> rank among its request's phase-2 candidates (-1: not a candidate)
  index_t* escan;     // N: exclusive scan of phase-2 candidate flags over rsorted positions
  index_t* cap;       // B
  index_t* t1;        // B: taken in phase 1
  index_t* t2;        // B: taken in phase 2
  uint64_t* cut;      // 2: T1, T2
};

ECHO_HD void fused_init_node(const AllocationArgs& a, const FusedScratch& s, index_t i) {
  const bool root = a.tree.depths[i] == 0;
  a.out.selected[i] = root ? 1 : 0;
  a.out.phase[i] = root ? 0 : -1;
  s.ekey1[i] = kNoKey;
  s.ekey2[i] = kNoKey;
  s.rank1[i] = -1;
  s.rank2[i] = -1;
}

// One thread per request, after fused_init_node of its nodes: the spine's keys sorted at ekey1[cu[r] ..] (a spine
// has at most depth nodes: insertion sort), ranks recorded, keys ranked at or past the cap dropped.
ECHO_HD void fused_spine(const AllocationArgs& a, const FusedScratch& s, index_t r) {
  const index_t base = a.tree.cu[r];
  s.cap[r] = request_cap(a);
  index_t count = 0;
  for (index_t n = find_spine_end(a, r); n >= 0 && a.tree.depths[n] > 0;) {
    uint64_t key = composite_key(a.tree, n);
    index_t j = count++;
    for (; j > 0 && s.ekey1[base + j - 1] > key; --j) s.ekey1[base + j] = s.ekey1[base + j - 1];
    s.ekey1[base + j] = key;
    n = a.tree.parents[n] >= 0 ? base + a.tree.parents[n] : -1;
  }
  for (index_t j = 0; j < count; ++j) {
    s.rank1[key_node(s.ekey1[base + j])] = j;
    if (j >= s.cap[r]) s.ekey1[base + j] = kNoKey;
  }
}

ECHO_HD bool taken_in_phase1(const AllocationArgs& a, const FusedScratch& s, index_t node, index_t r, uint64_t t1) {
  const index_t k = s.rank1[node];
  return k >= 0 && k < s.cap[r] && composite_key(a.tree, node) <= t1;
}

ECHO_HD bool is_phase2_candidate(const AllocationArgs& a, const FusedScratch& s, index_t node, index_t r,
                                 uint64_t t1) {
  return a.tree.depths[node] > 0 && !taken_in_phase1(a, s, node, r, t1);
}

// Keys of request r in ekey (ascending, kNoKey-padded) that are <= cut.
ECHO_HD index_t count_at_most(const uint64_t* ekey, index_t lo, index_t hi, uint64_t cut) {
  while (lo < hi) {  // first position whose key exceeds the cut
    const index_t mid = lo + (hi - lo) / 2;
    if (ekey[mid] <= cut && ekey[mid] != kNoKey) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Rsorted position j, after escan: its node's phase-2 rank and, when eligible, its key at ekey2.
ECHO_HD void fused_rank2(const AllocationArgs& a, const FusedScratch& s, index_t j, uint64_t t1) {
  const index_t node = s.rsorted[j], r = s.rreq[j], lo = a.tree.cu[r];
  if (!is_phase2_candidate(a, s, node, r, t1)) return;
  const index_t k = s.escan[j] - s.escan[lo];
  s.rank2[node] = k;
  if (k < s.cap[r] - s.t1[r]) s.ekey2[lo + k] = composite_key(a.tree, node);
}

ECHO_HD void fused_take(const AllocationArgs& a, const FusedScratch& s, index_t i) {
  const index_t r = request_of(a.tree.cu, a.tree.batch_size, i);
  if (taken_in_phase1(a, s, i, r, s.cut[0])) {
    a.out.selected[i] = 1;
    a.out.phase[i] = 1;
  } else if (s.rank2[i] >= 0 && s.rank2[i] < s.cap[r] - s.t1[r] && composite_key(a.tree, i) <= s.cut[1]) {
    a.out.selected[i] = 1;
    a.out.phase[i] = 2;
  }
  if (i < a.tree.batch_size) a.out.num_nodes[i] = 1 + s.t1[i] + s.t2[i];
}

namespace host {

// The want smallest keys of ekey[0, n) (kNoKey entries ignored): the largest of them (kNoKey: all are taken,
// 0: none). Sets *valid to the number of real keys.
inline uint64_t select_cut(const uint64_t* ekey, index_t n, index_t want, index_t* valid) {
  std::vector<uint64_t> keys;
  for (index_t i = 0; i < n; ++i)
    if (ekey[i] != kNoKey) keys.push_back(ekey[i]);
  *valid = static_cast<index_t>(keys.size());
  if (*valid <= want) return kNoKey;
  if (want == 0) return 0;
  std::nth_element(keys.begin(), keys.begin() + (want - 1), keys.end());
  return keys[want - 1];
}

inline void allocate_budget_fused(const AllocationArgs& a) {
  const index_t n = a.tree.num_nodes, b = a.tree.batch_size;
  std::vector<uint64_t> ekey1(n), ekey2(n);
  std::vector<index_t> rsorted(n), rreq(n), rank1(n), rank2(n), escan(n), cap(b), t1(b), t2(b);
  uint64_t cut[2];
  const FusedScratch s{nullptr, ekey1.data(), ekey2.data(), rsorted.data(), rreq.data(), rank1.data(),
                       rank2.data(), escan.data(), cap.data(), t1.data(), t2.data(), cut};
  // 1. per request
  for (index_t i = 0; i < n; ++i) fused_init_node(a, s, i);
  for (index_t r = 0; r < b; ++r) {
    fused_spine(a, s, r);
    const index_t lo = a.tree.cu[r], hi = a.tree.cu[r + 1];
    std::vector<uint64_t> keys;
    for (index_t i = lo; i < hi; ++i) keys.push_back(composite_key(a.tree, i));
    std::sort(keys.begin(), keys.end());
    for (index_t j = lo; j < hi; ++j) {
      s.rsorted[j] = key_node(keys[j - lo]);
      s.rreq[j] = r;
    }
  }
  // 2. the cuts
  index_t valid1 = 0, valid2 = 0, acc = 0;
  const index_t spare = a.budget - b;
  cut[0] = select_cut(s.ekey1, n, spare, &valid1);
  for (index_t r = 0; r < b; ++r) t1[r] = count_at_most(s.ekey1, a.tree.cu[r], a.tree.cu[r + 1], cut[0]) - a.tree.cu[r];
  const index_t took1 = valid1 < spare ? valid1 : spare;
  for (index_t j = 0; j < n; ++j) {
    s.escan[j] = acc;
    acc += is_phase2_candidate(a, s, s.rsorted[j], s.rreq[j], cut[0]) ? 1 : 0;
  }
  for (index_t j = 0; j < n; ++j) fused_rank2(a, s, j, cut[0]);
  cut[1] = select_cut(s.ekey2, n, spare - took1, &valid2);
  for (index_t r = 0; r < b; ++r) t2[r] = count_at_most(s.ekey2, a.tree.cu[r], a.tree.cu[r + 1], cut[1]) - a.tree.cu[r];
  const index_t took2 = valid2 < spare - took1 ? valid2 : spare - took1;
  *a.out.order_len = took1 + took2;
  // 3. per node
  for (index_t i = 0; i < n; ++i) fused_take(a, s, i);
}

}  // namespace host

}  // namespace echo

#if defined(ECHO_DEVICE_BUILD)
#include <cub/block/block_scan.cuh>
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

// ---- fused path: three kernels --------------------------------------------------------------------------

constexpr int kFusedRequestThreads = 256;
constexpr int kFusedCutThreads = 1024;
constexpr index_t kSharedSortKeys = 4096;  // a request of up to this many nodes sorts in shared memory

inline size_t fused_carve(void* workspace, index_t n, index_t b, FusedScratch* s) {
  Carver c{static_cast<char*>(workspace)};
  s->sort = c.take<uint64_t>(2 * static_cast<size_t>(n));
  s->ekey1 = c.take<uint64_t>(n);
  s->ekey2 = c.take<uint64_t>(n);
  s->rsorted = c.take<index_t>(n);
  s->rreq = c.take<index_t>(n);
  s->rank1 = c.take<index_t>(n);
  s->rank2 = c.take<index_t>(n);
  s->escan = c.take<index_t>(n);
  s->cap = c.take<index_t>(b);
  s->t1 = c.take<index_t>(b);
  s->t2 = c.take<index_t>(b);
  s->cut = c.take<uint64_t>(2);
  return c.used;
}

// Ascending bitonic sort of p (a power of two) keys by the whole block.
__device__ inline void block_bitonic_sort(uint64_t* keys, index_t p) {
  for (index_t k = 2; k <= p; k <<= 1) {
    for (index_t j = k >> 1; j > 0; j >>= 1) {
      for (index_t i = threadIdx.x; i < p; i += blockDim.x) {
        const index_t l = i ^ j;
        if (l > i) {
          const uint64_t x = keys[i], y = keys[l];
          if ((x > y) == ((i & k) == 0)) {
            keys[i] = y;
            keys[l] = x;
          }
        }
      }
      __syncthreads();
    }
  }
}

// Step 1, one block per request.
__global__ void __launch_bounds__(kFusedRequestThreads) fused_request_kernel(AllocationArgs a, FusedScratch s) {
  __shared__ uint64_t shared_keys[kSharedSortKeys];
  const index_t r = blockIdx.x, lo = a.tree.cu[r], n = a.tree.cu[r + 1] - lo;
  for (index_t i = lo + threadIdx.x; i < lo + n; i += blockDim.x) fused_init_node(a, s, i);
  __syncthreads();
  if (threadIdx.x == 0) fused_spine(a, s, r);
  index_t p = 1;
  while (p < n) p <<= 1;
  uint64_t* keys = p <= kSharedSortKeys ? shared_keys : s.sort + 2 * static_cast<size_t>(lo);
  for (index_t i = threadIdx.x; i < p; i += blockDim.x) keys[i] = i < n ? composite_key(a.tree, lo + i) : kNoKey;
  __syncthreads();
  block_bitonic_sort(keys, p);
  for (index_t j = threadIdx.x; j < n; j += blockDim.x) {
    s.rsorted[lo + j] = key_node(keys[j]);
    s.rreq[lo + j] = r;
  }
}

// The want smallest keys of keys[0, n) (kNoKey ignored), by the whole block: a radix select, 8 bits per pass from
// the top (keys are unique, so the want-th smallest is one exact key). Returns kNoKey when every real key is
// taken, 0 when none is; *valid = the number of real keys (all threads).
__device__ inline uint64_t block_select_cut(const uint64_t* keys, index_t n, index_t want, index_t* valid) {
  __shared__ index_t hist[256];
  __shared__ index_t count, rank;
  __shared__ uint64_t prefix;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  index_t mine = 0;
  for (index_t i = threadIdx.x; i < n; i += blockDim.x) mine += keys[i] != kNoKey;
  atomicAdd(&count, mine);
  __syncthreads();
  *valid = count;
  if (count <= want) return kNoKey;
  if (want == 0) return 0;
  if (threadIdx.x == 0) {
    rank = want - 1;
    prefix = 0;
  }
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int d = threadIdx.x; d < 256; d += blockDim.x) hist[d] = 0;
    __syncthreads();
    const uint64_t high = shift == 56 ? 0 : ~((uint64_t(1) << (shift + 8)) - 1);  // digits already fixed
    const uint64_t fixed = prefix;
    for (index_t i = threadIdx.x; i < n; i += blockDim.x) {
      const uint64_t k = keys[i];
      if (k != kNoKey && (k & high) == fixed) atomicAdd(&hist[(k >> shift) & 0xFF], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      index_t below = 0;
      for (int d = 0; d < 256; ++d) {
        if (rank < below + hist[d]) {
          prefix |= static_cast<uint64_t>(d) << shift;
          rank -= below;
          break;
        }
        below += hist[d];
      }
    }
    __syncthreads();
  }
  return prefix;
}

// Step 2, one block: both cuts and the phase-2 ranks between them.
__global__ void __launch_bounds__(kFusedCutThreads) fused_cut_kernel(AllocationArgs a, FusedScratch s) {
  using BlockScan = cub::BlockScan<index_t, kFusedCutThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ index_t carry;
  const index_t n = a.tree.num_nodes, b = a.tree.batch_size, spare = a.budget - b;
  index_t valid1 = 0, valid2 = 0;
  const uint64_t cut1 = block_select_cut(s.ekey1, n, spare, &valid1);
  for (index_t r = threadIdx.x; r < b; r += blockDim.x)
    s.t1[r] = count_at_most(s.ekey1, a.tree.cu[r], a.tree.cu[r + 1], cut1) - a.tree.cu[r];
  const index_t took1 = valid1 < spare ? valid1 : spare;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (index_t base = 0; base < n; base += blockDim.x) {  // exclusive scan of phase-2 candidate flags
    const index_t j = base + threadIdx.x;
    const index_t flag = j < n && is_phase2_candidate(a, s, s.rsorted[j], s.rreq[j], cut1) ? 1 : 0;
    index_t before = 0, total = 0;
    BlockScan(scan_storage).ExclusiveSum(flag, before, total);
    if (j < n) s.escan[j] = carry + before;
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  for (index_t j = threadIdx.x; j < n; j += blockDim.x) fused_rank2(a, s, j, cut1);
  __syncthreads();
  const uint64_t cut2 = block_select_cut(s.ekey2, n, spare - took1, &valid2);
  for (index_t r = threadIdx.x; r < b; r += blockDim.x)
    s.t2[r] = count_at_most(s.ekey2, a.tree.cu[r], a.tree.cu[r + 1], cut2) - a.tree.cu[r];
  if (threadIdx.x == 0) {
    s.cut[0] = cut1;
    s.cut[1] = cut2;
    const index_t took2 = valid2 < spare - took1 ? valid2 : spare - took1;
    *a.out.order_len = took1 + took2;
  }
}

// Step 3, one thread per node.
__global__ void fused_take_kernel(AllocationArgs a, FusedScratch s) {
  const index_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < a.tree.num_nodes) fused_take(a, s, i);
}

}  // namespace detail

// Bytes of device workspace `allocate_budget` needs for n nodes and b requests (either path).
inline cudaError_t allocation_workspace_bytes(index_t n, index_t b, size_t* bytes) {
  detail::DeviceScratch d{};
  cudaError_t err = detail::carve(nullptr, n, b, &d, bytes);
  FusedScratch f{};
  const size_t fused = detail::fused_carve(nullptr, n, b, &f);
  if (fused > *bytes) *bytes = fused;
  return err;
}

// The fused path (three kernels, no taken order): for n <= kFusedMaxNodes and a.out.order == nullptr.
inline cudaError_t allocate_budget_fused(const AllocationArgs& a, void* workspace, cudaStream_t stream) {
  FusedScratch s{};
  detail::fused_carve(workspace, a.tree.num_nodes, a.tree.batch_size, &s);
  detail::fused_request_kernel<<<a.tree.batch_size, detail::kFusedRequestThreads, 0, stream>>>(a, s);
  detail::fused_cut_kernel<<<1, detail::kFusedCutThreads, 0, stream>>>(a, s);
  detail::fused_take_kernel<<<(a.tree.num_nodes + 255) / 256, 256, 0, stream>>>(a, s);
  return cudaGetLastError();
}

// Asynchronous on `stream`; every pointer is device memory. Arguments are checked by the C ABI.
inline cudaError_t allocate_budget(const AllocationArgs& a, void* workspace, size_t workspace_bytes,
                                   cudaStream_t stream) {
  const index_t n = a.tree.num_nodes, b = a.tree.batch_size;
  size_t total = 0;
  cudaError_t err = allocation_workspace_bytes(n, b, &total);
  if (err != cudaSuccess) return err;
  if (workspace_bytes < total) return cudaErrorInvalidValue;
  if (a.out.order == nullptr && n <= kFusedMaxNodes) return allocate_budget_fused(a, workspace, stream);
  detail::DeviceScratch d{};
  size_t need = 0;
  err = detail::carve(workspace, n, b, &d, &need);
  if (err != cudaSuccess) return err;
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
