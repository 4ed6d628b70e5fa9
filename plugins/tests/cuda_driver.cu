// CUDA driver of the C ABI, for a machine with a GPU (scripts/gpu_check.sh runs it; it needs no Python):
//
//   echo_cuda_driver check [--small]   the CUDA entry points against the host entry points on random Super-Trees
//                                      (gate, allocation with and without the per-request cap, pack of the
//                                      allocator's selection; N past 5k unless --small): outputs equal exactly.
//                                      --small keeps every launch small enough for compute-sanitizer's racecheck.
//   echo_cuda_driver bench [--iters N] the control step (gate at 3 depths + allocation + select & pack) timed with
//                                      CUDA events at B in {16, 64, 256} x K_max in {512, 2048}, launched plainly
//                                      and replayed from a CUDA graph captured once; one JSON object per line.
//
// Exit status: 0 when every check passed, 1 otherwise.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "echo/echo_abi.h"

namespace {

int failures = 0;

#define CHECK_CUDA(call)                                                                              \
  do {                                                                                                \
    cudaError_t err_ = (call);                                                                        \
    if (err_ != cudaSuccess) {                                                                        \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_));   \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)

#define CHECK_ABI(call)                                                                               \
  do {                                                                                                \
    int rc_ = (call);                                                                                 \
    if (rc_ != ECHO_OK) {                                                                             \
      std::fprintf(stderr, "%s:%d: %s returned %d: %s\n", __FILE__, __LINE__, #call, rc_, echo_last_error()); \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)

#define EXPECT(cond, what)                                                                            \
  do {                                                                                                \
    if (!(cond)) {                                                                                    \
      std::fprintf(stderr, "MISMATCH %s (%s:%d)\n", what, __FILE__, __LINE__);                        \
      ++failures;                                                                                     \
    }                                                                                                 \
  } while (0)

// A request-major Super-Tree: random parents (parent < child), path probabilities monotone along paths with
// exact ties, depths from the parents.
struct Tree {
  int32_t batch_size = 0;
  std::vector<int32_t> cu, parents, depths;
  std::vector<float> probs;
  int32_t nodes() const { return cu.back(); }
};

Tree random_tree(int32_t batch_size, int32_t max_nodes, std::mt19937& rng) {
  Tree t;
  t.batch_size = batch_size;
  t.cu.push_back(0);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int32_t r = 0; r < batch_size; ++r) {
    const int32_t n = 1 + static_cast<int32_t>(rng() % max_nodes);
    const int32_t base = t.cu.back();
    for (int32_t i = 0; i < n; ++i) {
      const int32_t p = i == 0 ? -1 : static_cast<int32_t>(rng() % i);
      t.parents.push_back(p);
      t.depths.push_back(p < 0 ? 0 : t.depths[base + p] + 1);
      const float factor = u(rng) < 0.2f ? 0.5f : u(rng);  // ties
      t.probs.push_back(p < 0 ? 1.0f : t.probs[base + p] * factor);
    }
    t.cu.push_back(base + n);
  }
  return t;
}

// Device copy of a host vector (freed by the caller).
template <typename T>
T* to_device(const std::vector<T>& v) {
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(v.size(), 1) * sizeof(T)));
  if (!v.empty()) CHECK_CUDA(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <typename T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> v(n);
  if (n) CHECK_CUDA(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

void* device_bytes(size_t bytes) {
  void* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(bytes, 1)));
  return d;
}

// The nodes of one depth (level-major view): their path probabilities and requests, for the gate.
void level_of(const Tree& t, int32_t depth, std::vector<float>* probs, std::vector<int32_t>* req) {
  probs->clear();
  req->clear();
  for (int32_t r = 0; r < t.batch_size; ++r)
    for (int32_t i = t.cu[r]; i < t.cu[r + 1]; ++i)
      if (t.depths[i] == depth) {
        probs->push_back(t.probs[i]);
        req->push_back(r);
      }
}

void check_gate(const Tree& t, std::mt19937& rng) {
  std::vector<float> probs;
  std::vector<int32_t> req;
  level_of(t, 1, &probs, &req);
  const int32_t b = t.batch_size, m = static_cast<int32_t>(probs.size());
  std::vector<uint8_t> active(b);
  for (auto& a : active) a = rng() % 4 != 0;
  for (float tau : {0.0f, 0.25f, 0.6f}) {
    std::vector<float> conf(b);
    std::vector<uint8_t> passed(b);
    CHECK_ABI(echo_gate_host(probs.data(), req.data(), active.data(), m, b, tau, conf.data(), passed.data()));
    float* d_probs = to_device(probs);
    int32_t* d_req = to_device(req);
    uint8_t* d_active = to_device(active);
    auto* d_conf = static_cast<float*>(device_bytes(b * sizeof(float)));
    auto* d_passed = static_cast<uint8_t*>(device_bytes(b));
    CHECK_ABI(echo_gate_cuda(d_probs, d_req, d_active, m, b, tau, d_conf, d_passed, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    EXPECT(to_host(d_conf, b) == conf, "gate confidence");
    EXPECT(to_host(d_passed, b) == passed, "gate decision");
    for (void* p : {static_cast<void*>(d_probs), static_cast<void*>(d_req), static_cast<void*>(d_active),
                    static_cast<void*>(d_conf), static_cast<void*>(d_passed)})
      CHECK_CUDA(cudaFree(p));
  }
}

// Allocation on both paths, then pack of the host allocation's selection on both paths.
void check_allocation_and_pack(const Tree& t, int32_t budget, int32_t cap, std::mt19937& rng) {
  const int32_t b = t.batch_size, n = t.nodes();
  std::vector<int32_t> spine(b);
  for (auto& s : spine) s = static_cast<int32_t>(rng() % 5);
  std::vector<uint8_t> sel(n);
  std::vector<int8_t> phase(n);
  std::vector<int32_t> k(b), order(std::max(n - b, 1));
  int32_t order_len = -1;
  CHECK_ABI(echo_allocate_budget_host(t.probs.data(), t.depths.data(), t.parents.data(), t.cu.data(), b, n,
                                      spine.data(), budget, cap, sel.data(), phase.data(), k.data(), order.data(),
                                      &order_len));
  float* d_probs = to_device(t.probs);
  int32_t *d_depths = to_device(t.depths), *d_parents = to_device(t.parents), *d_cu = to_device(t.cu);
  int32_t* d_spine = to_device(spine);
  auto* d_sel = static_cast<uint8_t*>(device_bytes(n));
  auto* d_phase = static_cast<int8_t*>(device_bytes(n));
  auto* d_k = static_cast<int32_t*>(device_bytes(b * sizeof(int32_t)));
  auto* d_order = static_cast<int32_t*>(device_bytes(order.size() * sizeof(int32_t)));
  auto* d_order_len = static_cast<int32_t*>(device_bytes(sizeof(int32_t)));
  size_t ws_bytes = 0;
  CHECK_ABI(echo_allocate_budget_workspace_bytes(n, b, &ws_bytes));
  void* ws = device_bytes(ws_bytes);
  // One CUDA allocation (order NULL: the fused path) against the host's outputs. The outputs are filled with
  // sentinels first: an output a path forgot to write shows instead of an earlier call's value.
  auto check_cuda_allocation = [&](int32_t* d_order_or_null, const char* what) {
    CHECK_CUDA(cudaMemset(d_sel, 0xFF, n));
    CHECK_CUDA(cudaMemset(d_phase, 0x7F, n));
    CHECK_CUDA(cudaMemset(d_k, 0xFF, b * sizeof(int32_t)));
    CHECK_CUDA(cudaMemset(d_order_len, 0xFF, sizeof(int32_t)));
    CHECK_ABI(echo_allocate_budget_cuda(d_probs, d_depths, d_parents, d_cu, b, n, d_spine, budget, cap, d_sel, d_phase,
                                        d_k, d_order_or_null, d_order_len, ws, ws_bytes, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    const std::string label(what);
    EXPECT(to_host(d_sel, n) == sel, (label + ": selected").c_str());
    EXPECT(to_host(d_phase, n) == phase, (label + ": phase").c_str());
    EXPECT(to_host(d_k, b) == k, (label + ": K_i").c_str());
    EXPECT(to_host(d_order_len, 1)[0] == order_len, (label + ": order length").c_str());
  };
  check_cuda_allocation(d_order, "allocation");
  if (to_host(d_order_len, 1)[0] == order_len) {
    auto got = to_host(d_order, order_len);
    EXPECT(std::equal(got.begin(), got.end(), order.begin()), "allocation: order");
  }
  if (n <= ECHO_FUSED_ALLOCATION_MAX_NODES) {  // the fused path (no order): the same selection on both sides
    std::vector<uint8_t> sel_f(n);
    std::vector<int8_t> phase_f(n);
    std::vector<int32_t> k_f(b);
    int32_t len_f = -1;
    CHECK_ABI(echo_allocate_budget_host(t.probs.data(), t.depths.data(), t.parents.data(), t.cu.data(), b, n,
                                        spine.data(), budget, cap, sel_f.data(), phase_f.data(), k_f.data(), nullptr,
                                        &len_f));
    EXPECT(sel_f == sel && phase_f == phase && k_f == k && len_f == order_len, "fused host == multi-pass host");
    check_cuda_allocation(nullptr, "fused allocation");
  }
  // pack the selection; n_max = the largest K_i
  const int32_t total = [&] { int32_t s = 0; for (int32_t x : k) s += x; return s; }();
  const int32_t n_max = *std::max_element(k.begin(), k.end());
  std::vector<int32_t> ctx(b);
  for (auto& c : ctx) c = static_cast<int32_t>(rng() % 500);
  const int32_t words = (n_max + 31) / 32;
  std::vector<int32_t> cu_out(b + 1), len(b), src(total), par(total), dep(total), pos(total), off(size_t(b) * n_max),
      mask(size_t(total) * words);
  CHECK_ABI(echo_pack_host(t.parents.data(), t.cu.data(), sel.data(), ctx.data(), b, n, total, n_max, cu_out.data(),
                           len.data(), src.data(), par.data(), dep.data(), pos.data(), off.data(), mask.data()));
  int32_t* d_ctx = to_device(ctx);
  auto out = [](size_t count) { return static_cast<int32_t*>(device_bytes(count * sizeof(int32_t))); };
  int32_t *d_cu_out = out(b + 1), *d_len = out(b), *d_src = out(total), *d_par = out(total), *d_dep = out(total),
          *d_pos = out(total), *d_off = out(off.size()), *d_mask = out(mask.size());
  size_t pack_bytes = 0;
  CHECK_ABI(echo_pack_workspace_bytes(n, &pack_bytes));
  void* pws = device_bytes(pack_bytes);
  CHECK_ABI(echo_pack_cuda(d_parents, d_cu, d_sel, d_ctx, b, n, total, n_max, d_cu_out, d_len, d_src, d_par, d_dep,
                           d_pos, d_off, d_mask, pws, pack_bytes, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  EXPECT(to_host(d_cu_out, b + 1) == cu_out, "pack: cu");
  EXPECT(to_host(d_len, b) == len, "pack: generation_lengths");
  EXPECT(to_host(d_src, total) == src, "pack: src_index");
  EXPECT(to_host(d_pos, total) == pos, "pack: position_ids");
  EXPECT(to_host(d_off, off.size()) == off, "pack: position_offsets");
  EXPECT(to_host(d_mask, mask.size()) == mask, "pack: packed_mask");
  for (void* p : {static_cast<void*>(d_probs), static_cast<void*>(d_depths), static_cast<void*>(d_parents),
                  static_cast<void*>(d_cu), static_cast<void*>(d_spine), static_cast<void*>(d_sel),
                  static_cast<void*>(d_phase), static_cast<void*>(d_k), static_cast<void*>(d_order),
                  static_cast<void*>(d_order_len), ws, static_cast<void*>(d_ctx), static_cast<void*>(d_cu_out),
                  static_cast<void*>(d_len), static_cast<void*>(d_src), static_cast<void*>(d_par),
                  static_cast<void*>(d_dep), static_cast<void*>(d_pos), static_cast<void*>(d_off),
                  static_cast<void*>(d_mask), pws})
    CHECK_CUDA(cudaFree(p));
}

int run_checks(bool small) {
  std::mt19937 rng(2026);
  struct Case { int32_t batch_size, max_nodes; };
  std::vector<Case> cases = small ? std::vector<Case>{{1, 33}, {5, 40}, {33, 12}}
                                  : std::vector<Case>{{1, 33}, {7, 65}, {64, 40}, {257, 12}, {256, 64}, {256, 160}};
  for (const Case& c : cases) {
    const Tree t = random_tree(c.batch_size, c.max_nodes, rng);
    check_gate(t, rng);
    const int32_t b = c.batch_size, n = t.nodes();
    for (int32_t budget : {b, b + 1, (b + n) / 2, n + 5})
      for (int32_t cap : {0, 3, c.max_nodes}) check_allocation_and_pack(t, budget, cap, rng);
    std::printf("check B=%d N=%d: %s\n", b, n, failures ? "MISMATCHES" : "equal");
  }
  std::printf("%s\n", failures ? "FAILED" : "all CUDA outputs equal the host path");
  return failures ? 1 : 0;
}

// ---- benchmark ----------------------------------------------------------------------------------------------

struct StepBuffers {
  int32_t b = 0, n = 0, k_max = 0, n_max = 0, cap = 0;
  bool fused = false;  // allocate without the taken order (the fused path)
  std::vector<int32_t> gate_counts;  // level nodes per gate depth
  float* probs;
  int32_t *depths, *parents, *cu, *spine, *ctx;
  float* level_probs[3];
  int32_t* level_req[3];
  uint8_t *active, *passed, *sel;
  float* conf;
  int8_t* phase;
  int32_t *k, *order, *order_len, *cu_out, *len, *src, *par, *dep, *pos, *off, *mask;
  void *alloc_ws, *pack_ws;
  size_t alloc_bytes = 0, pack_bytes = 0;
};

StepBuffers make_step(const Tree& t, int32_t k_max, int32_t cap) {
  StepBuffers s;
  s.b = t.batch_size;
  s.n = t.nodes();
  s.k_max = k_max;
  s.cap = cap;
  s.n_max = cap;
  s.probs = to_device(t.probs);
  s.depths = to_device(t.depths);
  s.parents = to_device(t.parents);
  s.cu = to_device(t.cu);
  s.spine = to_device(std::vector<int32_t>(s.b, 3));
  s.ctx = to_device(std::vector<int32_t>(s.b, 1024));
  const int32_t gate_depths[3] = {1, 3, 6};
  for (int g = 0; g < 3; ++g) {
    std::vector<float> p;
    std::vector<int32_t> r;
    level_of(t, gate_depths[g], &p, &r);
    s.gate_counts.push_back(static_cast<int32_t>(p.size()));
    s.level_probs[g] = to_device(p);
    s.level_req[g] = to_device(r);
  }
  s.active = to_device(std::vector<uint8_t>(s.b, 1));
  s.passed = static_cast<uint8_t*>(device_bytes(s.b));
  s.conf = static_cast<float*>(device_bytes(s.b * sizeof(float)));
  s.sel = static_cast<uint8_t*>(device_bytes(s.n));
  s.phase = static_cast<int8_t*>(device_bytes(s.n));
  auto out = [](size_t count) { return static_cast<int32_t*>(device_bytes(count * sizeof(int32_t))); };
  s.k = out(s.b);
  s.order = out(s.n);
  s.order_len = out(1);
  const int32_t rows = std::min(k_max, s.n);
  s.cu_out = out(s.b + 1);
  s.len = out(s.b);
  s.src = out(rows);
  s.par = out(rows);
  s.dep = out(rows);
  s.pos = out(rows);
  s.off = out(size_t(s.b) * s.n_max);
  s.mask = out(size_t(rows) * ((s.n_max + 31) / 32));
  CHECK_ABI(echo_allocate_budget_workspace_bytes(s.n, s.b, &s.alloc_bytes));
  CHECK_ABI(echo_pack_workspace_bytes(s.n, &s.pack_bytes));
  s.alloc_ws = device_bytes(s.alloc_bytes);
  s.pack_ws = device_bytes(s.pack_bytes);
  return s;
}

// One control step, enqueued on `stream` without any host synchronisation (capturable).
void enqueue_step(const StepBuffers& s, cudaStream_t stream) {
  for (int g = 0; g < 3; ++g)
    CHECK_ABI(echo_gate_cuda(s.level_probs[g], s.level_req[g], s.active, s.gate_counts[g], s.b, 0.1f, s.conf, s.passed,
                             stream));
  CHECK_ABI(echo_allocate_budget_cuda(s.probs, s.depths, s.parents, s.cu, s.b, s.n, s.spine, s.k_max, s.cap, s.sel,
                                      s.phase, s.k, s.fused ? nullptr : s.order, s.order_len, s.alloc_ws,
                                      s.alloc_bytes, stream));
  CHECK_ABI(echo_pack_cuda(s.parents, s.cu, s.sel, s.ctx, s.b, s.n, std::min(s.k_max, s.n), s.n_max, s.cu_out, s.len,
                           s.src, s.par, s.dep, s.pos, s.off, s.mask, s.pack_ws, s.pack_bytes, stream));
}

float time_plain(const StepBuffers& s, cudaStream_t stream, int iters) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 10; ++i) enqueue_step(s, stream);
  CHECK_CUDA(cudaEventRecord(start, stream));
  for (int i = 0; i < iters; ++i) enqueue_step(s, stream);
  CHECK_CUDA(cudaEventRecord(stop, stream));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  return 1000.0f * ms / iters;
}

float time_graph(const StepBuffers& s, cudaStream_t stream, int iters, int* kernels) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  enqueue_step(s, stream);
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  size_t nodes = 0;
  CHECK_CUDA(cudaGraphGetNodes(graph, nullptr, &nodes));
  *kernels = static_cast<int>(nodes);
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 10; ++i) CHECK_CUDA(cudaGraphLaunch(exec, stream));
  CHECK_CUDA(cudaEventRecord(start, stream));
  for (int i = 0; i < iters; ++i) CHECK_CUDA(cudaGraphLaunch(exec, stream));
  CHECK_CUDA(cudaEventRecord(stop, stream));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  return 1000.0f * ms / iters;
}

int run_bench(int iters) {
  std::mt19937 rng(7);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  for (int32_t b : {16, 64, 256}) {
    const Tree t = random_tree(b, 120, rng);  // ~60 nodes per request on average: N ~ 15.5k at B = 256
    for (int32_t k_max : {512, 2048}) {
      if (k_max < b) continue;
      StepBuffers s = make_step(t, k_max, 64);
      for (bool fused : {true, false}) {
        if (fused && s.n > ECHO_FUSED_ALLOCATION_MAX_NODES) continue;
        s.fused = fused;
        int graph_nodes = 0;
        const float plain = time_plain(s, stream, iters);
        const float graph = time_graph(s, stream, iters, &graph_nodes);
        std::printf("{\"batch_size\": %d, \"k_max\": %d, \"nodes\": %d, \"allocation\": \"%s\", "
                    "\"us_per_step_plain\": %.2f, \"us_per_step_graph\": %.2f, \"graph_nodes\": %d, "
                    "\"iters\": %d}\n",
                    b, k_max, s.n, fused ? "fused" : "multi-pass", plain, graph, graph_nodes, iters);
      }
    }
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || (std::strcmp(argv[1], "check") && std::strcmp(argv[1], "bench"))) {
    std::fprintf(stderr, "usage: %s check [--small] | bench [--iters N]\n", argv[0]);
    return 2;
  }
  if (!echo_has_cuda()) {
    std::fprintf(stderr, "the linked ECHO library has no CUDA path\n");
    return 1;
  }
  if (!std::strcmp(argv[1], "check")) return run_checks(argc > 2 && !std::strcmp(argv[2], "--small"));
  int iters = 200;
  if (argc > 3 && !std::strcmp(argv[2], "--iters")) iters = std::atoi(argv[3]);
  return run_bench(iters);
}
