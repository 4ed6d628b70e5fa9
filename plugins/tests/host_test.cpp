// Host test binary: the C ABI on fixed cases with known answers (DESIGN.md section 4's tree, a budget example,
// the gate) plus invariants on pseudo-random trees. The exhaustive comparison with the Python core runs in
// tests/plugins (pytest); this binary needs no Python.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <random>
#include <vector>

#include "echo/echo_abi.h"

static int failures = 0;
#define EXPECT(cond)                                                  \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::fprintf(stderr, "FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

static void design_example() {
  const int32_t parents[] = {-1, 0, 0, 1}, cu[] = {0, 4};
  int32_t cu_out[2], len[1], src[4], par[4], dep[4], pos[4], off[4], mask[4];
  EXPECT(echo_pack_host(parents, cu, nullptr, nullptr, 1, 4, 4, 4, cu_out, len, src, par, dep, pos, off, mask) == ECHO_OK);
  EXPECT(mask[0] == 1 && mask[1] == 3 && mask[2] == 5 && mask[3] == 11);
  EXPECT(off[0] == 0 && off[1] == 1 && off[2] == 1 && off[3] == 2 && len[0] == 4);
}

static void budget_example() {
  // Request 0: root, a (.9, spine depth 1), b (.2); request 1: root, c (.6), d (.5, child of c). Spines: 0 -> a,
  // 1 -> none. Budget 4 = 2 roots + a (P1) + c (P2, the best remaining).
  const float probs[] = {1.f, .9f, .2f, 1.f, .6f, .5f};
  const int32_t depths[] = {0, 1, 1, 0, 1, 2}, parents[] = {-1, 0, 0, -1, 0, 1}, cu[] = {0, 3, 6}, spine[] = {1, 0};
  uint8_t sel[6];
  int8_t phase[6];
  int32_t k[2], order[4], order_len = -1;
  EXPECT(echo_allocate_budget_host(probs, depths, parents, cu, 2, 6, spine, 4, 0, sel, phase, k, order, &order_len) ==
         ECHO_OK);
  EXPECT(order_len == 2 && order[0] == 1 && order[1] == 4 && k[0] == 2 && k[1] == 2);
  EXPECT(phase[1] == 1 && phase[4] == 2 && phase[2] == -1 && phase[5] == -1 && sel[0] && sel[3]);
  // a budget below the batch size is an error with a message
  EXPECT(echo_allocate_budget_host(probs, depths, parents, cu, 2, 6, spine, 1, 0, sel, phase, k, order, &order_len) ==
         ECHO_INVALID_ARGUMENT);
  EXPECT(echo_last_error()[0] != '\0');
}

static void gate_example() {
  const float probs[] = {.3f, .7f, .1f};
  const int32_t req[] = {0, 0, 2};
  const uint8_t active[] = {1, 1, 1};
  float conf[3];
  uint8_t passed[3];
  EXPECT(echo_gate_host(probs, req, active, 3, 3, 0.5f, conf, passed) == ECHO_OK);
  EXPECT(conf[0] == .7f && conf[1] == 0.f && conf[2] == .1f && passed[0] == 1 && passed[1] == 0 && passed[2] == 0);
}

// Invariants on random trees: sum K_i <= budget, K_i <= cap, ancestor closure, order = taken non-roots.
static void random_invariants() {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int b = 1 + rng() % 40;
    std::vector<int32_t> cu{0}, parents, depths;
    std::vector<float> probs;
    for (int r = 0; r < b; ++r) {
      const int n = 1 + rng() % 70;
      for (int j = 0; j < n; ++j) {
        const int p = j == 0 ? -1 : static_cast<int>(rng() % j);
        parents.push_back(p);
        depths.push_back(p < 0 ? 0 : depths[cu.back() + p] + 1);
        probs.push_back(p < 0 ? 1.f : probs[cu.back() + p] * std::uniform_real_distribution<float>(0, 1)(rng));
      }
      cu.push_back(cu.back() + n);
    }
    const int n = cu.back(), budget = b + rng() % (n + 1), cap = rng() % 2 ? 0 : 1 + rng() % 10;
    std::vector<int32_t> spine(b), k(b), order(n), mask_parents(n);
    for (auto& s : spine) s = rng() % 6;
    std::vector<uint8_t> sel(n);
    std::vector<int8_t> phase(n);
    int32_t order_len = 0;
    EXPECT(echo_allocate_budget_host(probs.data(), depths.data(), parents.data(), cu.data(), b, n, spine.data(), budget,
                                     cap, sel.data(), phase.data(), k.data(), order.data(), &order_len) == ECHO_OK);
    int total = 0;
    for (int r = 0; r < b; ++r) {
      total += k[r];
      EXPECT(cap == 0 || k[r] <= cap);
      for (int i = cu[r] + 1; i < cu[r + 1]; ++i) EXPECT(!sel[i] || sel[cu[r] + parents[i]]);
    }
    EXPECT(total <= budget && order_len == total - b);
  }
}

// A step with no generation requests (TensorRT-LLM allows B = 0): every entry point succeeds and writes its
// trivial outputs; a batch of 0 requests with nodes is refused.
static void empty_batch() {
  int32_t cu[] = {0}, cu_out[] = {-1}, order_len = -1;
  EXPECT(echo_gate_host(nullptr, nullptr, nullptr, 0, 0, 0.5f, nullptr, nullptr) == ECHO_OK);
  EXPECT(echo_allocate_budget_host(nullptr, nullptr, nullptr, cu, 0, 0, nullptr, 0, 0, nullptr, nullptr, nullptr,
                                   nullptr, &order_len) == ECHO_OK && order_len == 0);
  EXPECT(echo_pack_host(nullptr, cu, nullptr, nullptr, 0, 0, 0, 1, cu_out, nullptr, nullptr, nullptr, nullptr, nullptr,
                        nullptr, nullptr) == ECHO_OK && cu_out[0] == 0);
  EXPECT(echo_pack_host(nullptr, cu, nullptr, nullptr, 0, 3, 0, 1, cu_out, nullptr, nullptr, nullptr, nullptr, nullptr,
                        nullptr, nullptr) == ECHO_INVALID_ARGUMENT);
}

// -0.0 is a probability equal to +0.0 (the core's sort and max treat them alike); NaN is refused by name.
static void signed_zero_and_nan() {
  const float probs[] = {1.f, -0.0f, 0.0f, 1.f, 0.0f, -0.0f};
  const int32_t depths[] = {0, 1, 1, 0, 1, 1}, parents[] = {-1, 0, 0, -1, 0, 0}, cu[] = {0, 3, 6}, spine[] = {0, 0};
  uint8_t sel[6];
  int8_t phase[6];
  int32_t k[2], order[4], order_len = -1;
  // budget 4: both roots, then the two best zeros in priority order: ties -> depth, then index (nodes 1 and 2)
  EXPECT(echo_allocate_budget_host(probs, depths, parents, cu, 2, 6, spine, 4, 0, sel, phase, k, order, &order_len) ==
         ECHO_OK);
  EXPECT(order_len == 2 && order[0] == 1 && order[1] == 2);
  const float level[] = {-0.0f, 0.0f};
  const int32_t req[] = {0, 1};
  const uint8_t active[] = {1, 1};
  float conf[2] = {-1.f, -1.f};
  uint8_t passed[2];
  EXPECT(echo_gate_host(level, req, active, 2, 2, 0.0f, conf, passed) == ECHO_OK);
  EXPECT(conf[0] == 0.0f && !std::signbit(conf[0]) && conf[1] == 0.0f && passed[0] == 0 && passed[1] == 0);
  const float nan_probs[] = {1.f, std::nanf(""), 0.5f, 1.f, 0.5f, 0.5f};
  EXPECT(echo_allocate_budget_host(nan_probs, depths, parents, cu, 2, 6, spine, 4, 0, sel, phase, k, order,
                                   &order_len) == ECHO_INVALID_ARGUMENT);
  EXPECT(std::strstr(echo_last_error(), "path_probs[1]") != nullptr);
  const float nan_level[] = {std::nanf(""), 0.5f};
  EXPECT(echo_gate_host(nan_level, req, active, 2, 2, 0.0f, conf, passed) == ECHO_INVALID_ARGUMENT);
}

// greedy acceptance over logits: root 0 -> 1 (tok 5), 2 (tok 7); 1 -> 3 (tok 2). The root's row peaks at 5 (node 1
// accepted), node 1's at 2 (node 3 accepted), node 3's at 9 (the bonus); node 2's row is never read
static void greedy_logits_example() {
  const int32_t vocab = 20;
  float logits[4 * vocab] = {};
  logits[0 * vocab + 5] = 3.f;
  logits[1 * vocab + 2] = 3.f;
  logits[2 * vocab + 4] = 3.f;
  logits[3 * vocab + 9] = 3.f;
  logits[3 * vocab + 17] = 3.f;  // a tie: the first index wins
  const int64_t ids[] = {11, 5, 7, 2};
  const int32_t parents[] = {-1, 0, 0, 1}, depths[] = {0, 1, 1, 2}, cu[] = {0, 4};
  int64_t nodes[3], tokens[3], counts[1], pred[4];
  EXPECT(echo_accept_greedy_logits_host(logits, vocab, vocab, 0, ids, parents, depths, cu, 1, 4, 3, nodes, tokens,
                                        counts, pred) == ECHO_OK);
  EXPECT(counts[0] == 3 && nodes[0] == 0 && nodes[1] == 1 && nodes[2] == 3);
  EXPECT(tokens[0] == 5 && tokens[1] == 2 && tokens[2] == 9);
  EXPECT(pred[0] == 5 && pred[1] == 2 && pred[2] == -1 && pred[3] == 9);
  EXPECT(echo_accept_greedy_logits_host(logits, vocab, vocab, 2, ids, parents, depths, cu, 1, 4, 3, nodes, tokens,
                                        counts, pred) == ECHO_INVALID_ARGUMENT);
  EXPECT(std::strstr(echo_last_error(), "dtype must be 0") != nullptr);
}

// one level of one request's three children replayed, then its next frontier of two slots: the scores' order is
// torch.sort's (NaN first, then higher, ties by the lower slot), the frontier in slot order
static void next_frontier_example() {
  const int64_t prev_req[] = {0}, prev_slots[] = {0}, front[] = {0}, tokens[] = {7, 8, 9}, row_of[] = {0};
  const float prev_path[] = {1.f}, parent_path[] = {1.f};
  const uint8_t fvalid[] = {1}, active_in[] = {1};
  const float cases[2][3] = {{0.2f, 0.5f, 0.5f}, {NAN, 0.5f, 0.1f}};
  const int64_t want_front[2][2] = {{1, 2}, {0, 1}};
  for (int c = 0; c < 2; ++c) {
    uint8_t active_out[1], out_fvalid[2];
    int64_t spine[1] = {0}, failed[1] = {0}, slot_of[1], req[3], par[3], tok[3], rank[3], slot[3], keep[1], nf[2],
            ntok[2], npar[2], claimed;
    float history[2] = {}, dprob[3], pprob[3], npath[2];
    int32_t num_frontier, num_active, num_kept, next_slots;
    double gain;
    EXPECT(echo_replay_level_next_host(prev_req, prev_path, prev_slots, 1, 1, front, fvalid, cases[c], tokens, 1, 1, 3,
                                       row_of, 1, 1, 2, 0, 0.f, 0, 0, nullptr, 0, active_in, active_out, spine, failed,
                                       history, slot_of, req, par, tok, dprob, pprob, rank, slot, &num_frontier,
                                       &num_active, &claimed, &gain, parent_path, 2, keep, nf, out_fvalid, npath, ntok,
                                       npar, &num_kept, &next_slots) == ECHO_OK);
    EXPECT(num_frontier == 1 && num_active == 1 && num_kept == 1 && next_slots == 2 && keep[0] == 0);
    EXPECT(nf[0] == want_front[c][0] && nf[1] == want_front[c][1]);
    EXPECT(ntok[0] == tokens[nf[0]] && ntok[1] == tokens[nf[1]] && npar[0] == 0 && npar[1] == 0);
    EXPECT(out_fvalid[0] == (c == 0) && out_fvalid[1] == 1);  // a NaN score is not >= 0
  }
}

int main() {
  std::printf("echo plugin host test (ABI %d, CUDA %s)\n", echo_abi_version(), echo_has_cuda() ? "yes" : "no");
  design_example();
  budget_example();
  gate_example();
  random_invariants();
  empty_batch();
  signed_zero_and_nan();
  greedy_logits_example();
  next_frontier_example();
  std::printf(failures ? "%d FAILED\n" : "all passed\n", failures);
  return failures ? EXIT_FAILURE : EXIT_SUCCESS;
}
