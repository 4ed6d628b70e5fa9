/* ECHO plugin C ABI (load with ctypes, dlopen, or link). All arrays are contiguous; index arrays are int32.
 * *_host functions take host pointers and run the reference path on the CPU; *_cuda functions take device
 * pointers and enqueue kernels on `stream` (a cudaStream_t, NULL = the default stream) without synchronising.
 * Every function returns ECHO_OK or an error code; echo_last_error() describes the last failure of the
 * calling thread (what was wrong and what is accepted). Layouts: DESIGN.md section 4. */
#ifndef ECHO_ABI_H_
#define ECHO_ABI_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ECHO_ABI_VERSION 2
/* The largest N for which echo_allocate_budget_* may be called with order = NULL on the CUDA path (fused). */
#define ECHO_FUSED_ALLOCATION_MAX_NODES 16384
enum { ECHO_OK = 0, ECHO_INVALID_ARGUMENT = 1, ECHO_CUDA_ERROR = 2, ECHO_NOT_BUILT_WITH_CUDA = 3 };

int echo_abi_version(void);
int echo_has_cuda(void);
const char* echo_last_error(void);

/* Gate at one level: confidence[i] = max path prob of request i's level nodes (0 if none);
 * passed[i] = active[i] && confidence[i] > tau. */
int echo_gate_host(const float* path_probs, const int32_t* request_ids, const uint8_t* active,
                   int32_t num_level_nodes, int32_t batch_size, float tau, float* confidence, uint8_t* passed);
int echo_gate_cuda(const float* path_probs, const int32_t* request_ids, const uint8_t* active,
                   int32_t num_level_nodes, int32_t batch_size, float tau, float* confidence, uint8_t* passed,
                   void* stream);

/* Elastic budget allocation over the request-major Super-Tree (N nodes, B requests, cu[B+1]).
 * max_nodes_per_request <= 0: no per-request cap. order has room for N - B entries; *order_len are valid.
 * order may be NULL when the taken order is not needed (*order_len is still written): for N <=
 * ECHO_FUSED_ALLOCATION_MAX_NODES the
 * allocation then runs fused (three kernels on the device: per request, one block for both budget cuts, per
 * node); the CUDA path requires order for larger N. */
int echo_allocate_budget_host(const float* path_probs, const int32_t* depths, const int32_t* parents,
                              const int32_t* cu, int32_t batch_size, int32_t num_nodes, const int32_t* spine_depth,
                              int32_t budget, int32_t max_nodes_per_request, uint8_t* selected, int8_t* phase,
                              int32_t* num_nodes_out, int32_t* order, int32_t* order_len);
int echo_allocate_budget_workspace_bytes(int32_t num_nodes, int32_t batch_size, size_t* bytes);
int echo_allocate_budget_cuda(const float* path_probs, const int32_t* depths, const int32_t* parents,
                              const int32_t* cu, int32_t batch_size, int32_t num_nodes, const int32_t* spine_depth,
                              int32_t budget, int32_t max_nodes_per_request, uint8_t* selected, int8_t* phase,
                              int32_t* num_nodes_out, int32_t* order, int32_t* order_len, void* workspace,
                              size_t workspace_bytes, void* stream);

/* Select (selected may be NULL = every node) and pack in TensorRT-LLM's layout; W = ceil(n_max / 32).
 * num_selected: the host path requires the exact count K; the CUDA path takes the rows available (>= K) and
 * computes K on the device (cu_out[B]), so a caller that cannot synchronise passes its upper bound (K_max).
 * Outputs: cu_out[B+1], generation_lengths[B], src_index/parents_out/depths_out/position_ids[num_selected],
 * position_offsets[B * n_max], packed_mask[num_selected * W]. context_lengths may be NULL. */
int echo_pack_host(const int32_t* parents, const int32_t* cu, const uint8_t* selected, const int32_t* context_lengths,
                   int32_t batch_size, int32_t num_nodes, int32_t num_selected, int32_t n_max, int32_t* cu_out,
                   int32_t* generation_lengths, int32_t* src_index, int32_t* parents_out, int32_t* depths_out,
                   int32_t* position_ids, int32_t* position_offsets, int32_t* packed_mask);
int echo_pack_workspace_bytes(int32_t num_nodes, size_t* bytes);
int echo_pack_cuda(const int32_t* parents, const int32_t* cu, const uint8_t* selected, const int32_t* context_lengths,
                   int32_t batch_size, int32_t num_nodes, int32_t num_selected, int32_t n_max, int32_t* cu_out,
                   int32_t* generation_lengths, int32_t* src_index, int32_t* parents_out, int32_t* depths_out,
                   int32_t* position_ids, int32_t* position_offsets, int32_t* packed_mask, void* workspace,
                   size_t workspace_bytes, void* stream);

/* ECHO's online acceptance estimates (echo_trtllm.core.acceptance.OnlineAcceptance.estimate), read off the fit
 * compiled into num_segments linear segments, host only. Segment s lies on table row r and starts at start[s];
 * keys[s] = 2 r + start[s], ascending. Node i (confidence c = confidences[i] clamped to [0, 1], table row rows[i])
 * falls in the last segment s with keys[s] <= 2 rows[i] + c, and
 *     out[i] = clamp(l0[s] + l1[s] (c - start[s]) + share[s] * prior, 0, 1),  prior = e0[s] + e1[s] c,
 * except on a row with deep[r] != 0 (deep may be NULL: none), where the prior is the depth-1 reading of row 0 to
 * the path's length d = r + 1: x = c^(1/d), e = clamp(l0[t] + l1[t] (x - start[t]) + share[t] x, 0, 1) at row 0's
 * segment t of x, prior = c (e / x)^d (x > 0) or e^d. A NaN confidence gives NaN. */
int echo_acceptance_estimate_host(const double* confidences, const int32_t* rows, int32_t num_nodes,
                                  const double* keys, const double* start, const double* l0, const double* l1,
                                  const double* share, const double* e0, const double* e1, int32_t num_segments,
                                  const uint8_t* deep, int32_t num_rows, double* out);

/* The online acceptance fit compiled into segments (echo_acceptance_estimate_host's arrays, one struct). */
typedef struct {
  const double *keys, *start, *l0, *l1, *share, *e0, *e1;
  int32_t num_segments;
  const uint8_t* deep; /* NULL: no row reads the depth-1 prior */
  int32_t num_rows;
} echo_segments;

/* One drafted level replayed on the host with ECHO's per-level decisions (echo_trtllm.core.policies._replay, one
 * level, then EchoPolicy.observe without the cost stop's last comparison), in one call.
 *
 * The previous level: prev_request_ids, prev_path_probs, prev_slots (each node's slot in its row's device level,
 * slots < slot_width), num_prev nodes. The device's level for its num_rows drafting rows: front (R, W) the
 * frontier's slots in the previous level, fvalid (R, W), probs and tokens (R, W, K). row_of (B,): each request's
 * device row, num_rows for a request off the device.
 *
 * A previous node is expanded iff its request is active and its slot is in its row's valid frontier; out_slot_of
 * (num_prev) is its frontier slot or -1. The expanded nodes' K children each, frontier-major, best first, go to the
 * out_* arrays (room for num_prev * K): request, parent (index into the previous level), token, draft probability,
 * path probability (parent's x own, float32), rank, device slot (w * K + j). *num_frontier: expanded nodes; 0 ends
 * drafting and nothing below runs.
 *
 * Then the level's decisions on the batch (B = batch_size): confidence (B) = each request's best path probability
 * at this level (0 where none), also written to history row depth - 1 ((max_levels, B), the earlier rows are
 * this step's earlier levels); with has_tau, a request fails the gate unless confidence > tau (failed_at = depth);
 * spine_depth = depth where still active; with budget_stop, when the active requests' confidences over the levels
 * so far outnumber budget_spare, a request stops unless its confidence at this level is >= their
 * budget_spare-th largest (budget_spare 0: every request stops). active_out (B) is the result (active_in is not
 * written). Finally *num_active, *claimed = B + sum of spine_depth, and with fit != NULL *gain = the sum of
 * the active requests' acceptance estimates at this level's confidence on fit row gain_row (the cost stop's
 * tokens); the caller compares them with the step's prices. */
int echo_replay_level_host(const int64_t* prev_request_ids, const float* prev_path_probs, const int64_t* prev_slots,
                           int32_t num_prev, int32_t slot_width, const int64_t* front, const uint8_t* fvalid,
                           const float* probs, const int64_t* tokens, int32_t num_rows, int32_t width,
                           int32_t children, const int64_t* row_of, int32_t batch_size, int32_t depth,
                           int32_t max_levels, int32_t has_tau, float tau, int32_t budget_stop, int32_t budget_spare,
                           const echo_segments* fit, int32_t gain_row, const uint8_t* active_in, uint8_t* active_out,
                           int64_t* spine_depth, int64_t* failed_at, float* history, int64_t* out_slot_of,
                           int64_t* out_request_ids, int64_t* out_parent_ids, int64_t* out_token_ids,
                           float* out_draft_probs, float* out_path_probs, int64_t* out_ranks, int64_t* out_slots,
                           int32_t* num_frontier, int32_t* num_active, int64_t* claimed, double* gain);

/* echo_replay_level_host (same arguments, same results), then the next level's frontier where the host drafts
 * level by level (echo_trtllm.core.policies._level_on_device's frontier choice and _keep_active, in the same call).
 * parent_path (R, W): the device's path probability of each frontier node (1 for the roots). This level's device
 * scores are parent_path x probs where fvalid, else -1 ((R, W * K) slots). For each row whose request is active
 * after the call (active_out), in row order: out_keep its row, and its next_width best slots (NaN first, then the
 * highest score, ties: the lowest slot; every slot where there are no more), in slot order: out_front the slot,
 * out_parent_path its score, out_fvalid score >= 0, out_next_tokens its token, out_next_parents slot / K (room for
 * R x min(next_width, W * K) each). *num_kept: the rows kept; *next_slots: min(next_width, W * K); both 0 where
 * drafting ended (no frontier, or no request active). */
int echo_replay_level_next_host(const int64_t* prev_request_ids, const float* prev_path_probs,
                                const int64_t* prev_slots, int32_t num_prev, int32_t slot_width, const int64_t* front,
                                const uint8_t* fvalid, const float* probs, const int64_t* tokens, int32_t num_rows,
                                int32_t width, int32_t children, const int64_t* row_of, int32_t batch_size,
                                int32_t depth, int32_t max_levels, int32_t has_tau, float tau, int32_t budget_stop,
                                int32_t budget_spare, const echo_segments* fit, int32_t gain_row,
                                const uint8_t* active_in, uint8_t* active_out, int64_t* spine_depth,
                                int64_t* failed_at, float* history, int64_t* out_slot_of, int64_t* out_request_ids,
                                int64_t* out_parent_ids, int64_t* out_token_ids, float* out_draft_probs,
                                float* out_path_probs, int64_t* out_ranks, int64_t* out_slots, int32_t* num_frontier,
                                int32_t* num_active, int64_t* claimed, double* gain, const float* parent_path,
                                int32_t next_width, int64_t* out_keep, int64_t* out_front, uint8_t* out_fvalid,
                                float* out_parent_path, int64_t* out_next_tokens, int64_t* out_next_parents,
                                int32_t* num_kept, int32_t* next_slots);

/* A step's drafting result in one call: the Super-Tree of the drafted levels (echo_tree_from_levels_host, same
 * level arguments; tree_ints (7, N) at stride N: token, parent, depth, rank, source, request, global parent;
 * tree_floats (2, N): draft and path probabilities; tree_cu (B + 1); tree_greedy (N)), its selection
 * (echo_select_host with those arrays and min_taken; selected, phase (N), num_nodes_out (B), order (N),
 * order_len), the selected sub-tree (echo_tree_select_host with mask = selected; sel_ints, sel_floats at stride N
 * as the tree's, sel_greedy, sel_cu (B + 1), *num_selected = M) and every node of it packed for verification
 * (echo_pack_host with context_lengths (B); packed_ints at stride M after cu: cu_out (B + 1), generation lengths
 * (B), parents (M), depths (M); offsets (B, n_max) and packed_mask (M, words_per_row(n_max)) contiguous; input_ids
 * and position_ids (M) int64; *n_max_out). The other outputs are sized for N nodes; offsets and packed_mask hold
 * offsets_capacity and mask_capacity entries, checked against B x n_max and M x words_per_row(n_max) before anything
 * is packed. */
int echo_draft_result_host(const int64_t* level_sizes, int32_t num_levels, const int64_t* request_ids,
                           const int64_t* parent_ids, const int64_t* token_ids, const float* draft_probs,
                           const float* path_probs, const int64_t* ranks, const int32_t* spine_depth, int32_t budget,
                           int32_t max_nodes_per_request, const echo_segments* fit, int32_t max_depth,
                           const double* seconds, int32_t num_seconds, int32_t min_taken,
                           const int32_t* context_lengths, int64_t* tree_ints, float* tree_floats, int64_t* tree_cu,
                           uint8_t* tree_greedy, uint8_t* selected, int8_t* phase, int32_t* num_nodes_out,
                           int32_t* order, int32_t* order_len, int64_t* sel_ints, float* sel_floats,
                           uint8_t* sel_greedy, int64_t* sel_cu, int64_t* num_selected, int64_t* input_ids,
                           int64_t* position_ids, int32_t* packed_ints, int32_t* offsets, int64_t offsets_capacity,
                           int32_t* packed_mask, int64_t mask_capacity, int32_t* n_max_out);

/* ECHO's selection (echo_trtllm.core.policies.EchoPolicy.select with a cost model) in one call:
 * echo_allocate_budget_host (same arguments; order required), then the budget rule along the taken order
 * (core.cost.choose_budget): with e_1, e_2, ... the acceptance estimates of the taken nodes on the fit (node i's
 * row: min(max(depth, 1), max_depth) - 1, plus max_depth off the draft's greedy path, greedy[i] == 0), the first n
 * maximising (batch_size + e_1 + ... + e_n) / seconds[n] is kept (seconds[n]: the step's seconds verifying the
 * roots and n more tokens, n = 0 .. min(num_nodes, budget) - batch_size); where that n is 0, the first
 * min(min_taken, taken) are kept instead (a speculation probe's floor: EchoPolicy.select's max(k, min_tokens) with
 * min_taken = min_tokens - batch_size; 0: the rule alone); the taken nodes after the n kept leave the selection
 * (phase -1, their request's count less one) and *order_len = n. */
int echo_select_host(const float* path_probs, const int32_t* depths, const int32_t* parents, const int32_t* cu,
                     int32_t batch_size, int32_t num_nodes, const int32_t* spine_depth, int32_t budget,
                     int32_t max_nodes_per_request, uint8_t* selected, int8_t* phase, int32_t* num_nodes_out,
                     int32_t* order, int32_t* order_len, const uint8_t* greedy, const echo_segments* fit,
                     int32_t max_depth, const double* seconds, int32_t num_seconds, int32_t min_taken);

/* ECHO's online acceptance counts (echo_trtllm.core.acceptance.OnlineAcceptance.observe_nodes): one verified
 * tree's nodes (roots, depth 0, skipped), the ones in accepted_ids accepted. Every cell of n, k and csum
 * ((2 max_depth, num_bins) row-major) is first multiplied by decay; then each draft node adds 1 to n, 1 if
 * accepted to k and its confidence c (clamped to [0, 1]) to csum at row min(depth, max_depth) - 1 (+ max_depth
 * off the greedy path) and the bin of c among edges (num_bins + 1 ascending; the last edge's bin is the last). */
int echo_acceptance_observe_host(const int64_t* depths, const float* confidences, const uint8_t* greedy,
                                 int32_t num_nodes, const int64_t* accepted_ids, int32_t num_accepted,
                                 int32_t max_depth, const double* edges, int32_t num_bins, double decay, double* n,
                                 double* k, double* csum);

/* The Super-Tree from drafted levels (echo_trtllm.core.tree.SuperTree.from_levels): num_levels levels of
 * level_sizes[d] nodes each, level-major and concatenated (level 0: request i's root at i, parent -1; a node's
 * parent_ids entry indexes the previous level), reordered request-major (a stable sort by request: within a request
 * by level, then level order). Out, per node of the tree (n = the sum of level_sizes): token, parent within its
 * request (-1: root), depth, draft and path probabilities, rank, its level-major index (source), request, parent as
 * a flat tree index, whether it is on the draft's greedy path (its parent is and its rank is 0); out_cu (B + 1). */
int echo_tree_from_levels_host(const int64_t* level_sizes, int32_t num_levels, const int64_t* request_ids,
                               const int64_t* parent_ids, const int64_t* token_ids, const float* draft_probs,
                               const float* path_probs, const int64_t* ranks, int64_t* out_token_ids,
                               int64_t* out_parents, int64_t* out_depths, float* out_draft_probs,
                               float* out_path_probs, int64_t* out_ranks, int64_t* out_cu, int64_t* out_source,
                               int64_t* out_request_ids, int64_t* out_global_parents, uint8_t* out_greedy);

/* The non-decreasing weighted least-squares fit of each of `rows` rows of y (rows x cols, row-major) with weights w
 * (> 0; pool adjacent violators: a block's mean is (m w + m' w') / (w + w'), pooled left to right), into out. */
int echo_isotonic_rows_host(const double* y, const double* w, int32_t rows, int32_t cols, double* out);

/* Rows copied between two row-major tables on the host: dst row dst_index[i] = src row src_index[i] (src_index
 * NULL: row i), i < n, each row_bytes bytes, rows dst_stride / src_stride bytes apart (>= row_bytes); indices within
 * [0, dst_rows) and [0, src_rows). The EAGLE-3 drafter's feature store takes the verification forward's rows of the
 * accepted tokens with it (echo_trtllm.runtime.drafter.FeatureStore.write; index_copy_ of the gathered rows is its
 * oracle). */
int echo_copy_rows_host(void* dst, int64_t dst_rows, int64_t dst_stride, const int64_t* dst_index, const void* src,
                        int64_t src_rows, int64_t src_stride, const int64_t* src_index, int64_t n, int64_t row_bytes);

/* ECHO's online acceptance refit without a calibration (echo_trtllm.core.acceptance.OnlineAcceptance: _fit, then
 * _segments_table, then threshold's estimates on its grid), in one call, host only. R = 2 max_depth rows of num_bins
 * bins (edges: num_bins + 1 ascending, 0 to 1); n, k, csum (R, num_bins): the decayed counts; mid (R, num_bins):
 * the bins' middles; p0 (R, num_bins): the prior at them (the draft's own probability); w0 = prior_weight > 0.
 *
 * The fit, into fit (3, R, num_bins): centres (csum / n where n > 1e-9, else mid), values (row 0: the isotonic fit
 * of (k + w0 p0) / (n + w0) with weights n + w0; rows 1 .. max_depth - 1 take the prior read off row 0's fit to the
 * depth's power, the class docstring's p0_d(c) = e1(c^(1/d))^d at mid; then every other row's isotonic fit as row
 * 0's) and p0 as used. The segments, into segments (7, R * 2 num_bins): keys, start, l0, l1, share, e0, e1 as
 * echo_acceptance_estimate_host reads them with deep = rows 1 .. max_depth - 1 (each row's starts: the bin edges
 * and its centres, sorted). The estimates of the greedy rows 0 .. max_depth - 1 at the num_grid confidences grid,
 * into grid_out (max_depth, num_grid). */
int echo_acceptance_refit_host(const double* n, const double* k, const double* csum, const double* mid,
                               const double* p0, int32_t max_depth, const double* edges, int32_t num_bins,
                               double prior_weight, const double* grid, int32_t num_grid, double* fit,
                               double* segments, double* grid_out);

/* The sub-tree of the nodes where mask is 1 (echo_trtllm.core.tree.SuperTree.select) of a Super-Tree of n nodes and
 * b requests (request-major; global_parents: each node's parent as a flat index, -1 for a root, < the node's own):
 * every root and every selected node's parent must be selected; the order is kept. Out, for the m selected nodes
 * (*out_m; the out arrays hold n entries): token, parent within its request, depth, draft and path probabilities,
 * rank, source index, request, parent as a flat index of the selection, and (where greedy is not NULL) the greedy
 * flag; out_cu (b + 1). */
int echo_tree_select_host(int64_t n, int64_t b, const uint8_t* mask, const int64_t* request_ids,
                          const int64_t* global_parents, const int64_t* token_ids, const int64_t* depths,
                          const float* draft_probs, const float* path_probs, const int64_t* ranks,
                          const int64_t* source, const uint8_t* greedy, int64_t* out_m, int64_t* out_token_ids,
                          int64_t* out_parents, int64_t* out_depths, float* out_draft_probs, float* out_path_probs,
                          int64_t* out_ranks, int64_t* out_source, int64_t* out_request_ids,
                          int64_t* out_global_parents, uint8_t* out_greedy, int64_t* out_cu);

/* One step of a phase's step-price filter (echo_trtllm.core.prices.KalmanLinear: `advance` then `update`), n
 * coefficients, theta (n) and cov (n x n, row-major, symmetric) updated in place. drift_now: apply the drift first
 * (cov += c outer(theta, theta) with c = drift_common (already times the steps it covers, squared), the diagonal
 * += e max(theta, floor)^2, a diagonal above cap[i] scaled back by a congruence, then symmetrised). The update
 * with the measurement y at features phi: the prediction max(phi . theta, min_seconds), the relative noise
 * (*noise x max(prediction, y, min_seconds))^2, the innovation clipped at huber standard deviations, the gain,
 * theta and cov updated, theta projected onto theta >= 0 in cov's metric (the coefficients that went negative held at
 * zero, the others moved by their covariance with them), and *noise moved to the running mean absolute relative
 * residual (at least noise_floor). out: [the prediction before the update, the noise variance used]. */
int echo_kalman_step_host(int32_t n, double* theta, double* cov, const double* phi, double y, const double* cap,
                          const double* floor, double drift_common, double drift_each, int32_t drift_now, double huber,
                          double* noise, double noise_floor, double noise_rate, double min_seconds, double* out);

/* Greedy acceptance over a packed verification batch (echo_trtllm.core.verify's `_accept_predicted` is its oracle):
 * per request, the deepest root path whose every draft equals pred at its parent (ties: the lowest node index),
 * then pred at its last node as the bonus token. num_nodes nodes, batch_size requests (cu[B+1]; each request's
 * first node is its root), parents within the request (-1: the root; each parent before its child), depths (the
 * parent's + 1), input_ids the token fed at each node, pred the target's top-1 after each node; width = the
 * deepest depth allowed + 1. Outputs, width columns per request: nodes (flat node indices of the path, root first,
 * -1 past its end) and tokens (the accepted drafts, then the bonus in every later column); counts[B]: accepted
 * drafts + 1. */
int echo_accept_greedy_host(const int64_t* input_ids, const int64_t* pred, const int32_t* parents,
                            const int32_t* depths, const int32_t* cu, int32_t batch_size, int32_t num_nodes,
                            int32_t width, int64_t* nodes, int64_t* tokens, int64_t* counts);

/* echo_accept_greedy_host reading the target's logits instead of pred: row j of logits (num_nodes rows of vocab
 * entries, row j at j * row_stride; dtype 0 float32, 1 bfloat16) gives the top-1 after node j (the first index of
 * its maximum, or of its first NaN: torch.argmax's answer), read only where the walk needs it: after a node on an
 * accepted path, and at each request's last accepted node (the bonus). pred (num_nodes): the top-1 of every row
 * read, -1 where none was. The whole tree is checked before any row is read. */
int echo_accept_greedy_logits_host(const void* logits, int64_t row_stride, int64_t vocab, int32_t dtype,
                                   const int64_t* input_ids, const int32_t* parents, const int32_t* depths,
                                   const int32_t* cu, int32_t batch_size, int32_t num_nodes, int32_t width,
                                   int64_t* nodes, int64_t* tokens, int64_t* counts, int64_t* pred);

#ifdef __cplusplus
}
#endif
#endif /* ECHO_ABI_H_ */
