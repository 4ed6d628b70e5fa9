"""ECHO control-plane kernels behind the core's signatures, with the implementation chosen in one place.

    gate(path_probs, request_ids, batch_size, active, tau)         -> (confidence, passed)
    allocate_budget(tree, spine_depth, budget, max_nodes_per_request) -> BudgetAllocation
    pack(tree, context_lengths=None, selected=None)                 -> PackedVerifyBatch (of tree.select(selected))

Backends: "cuda" — the plugin library's kernels (plugins/, built with CMake) on the tensors' CUDA device;
"host" — the same plugin sources compiled for the CPU (scripts/setup.sh builds it with the C++ compiler; CI
checks it against the core); "torch" — the core reference (echo_trtllm.core). `backend_for(device)` picks
"cuda" for a CUDA device and "host" for the CPU where that library is built, else "torch" (the runtime's
control plane runs its budget allocation and packing there: on the host a few dozen values are one C++ pass
instead of dozens of tensor operations, ~50 against ~280 us for an allocation at 16-64 requests); every function
also takes backend= explicitly. Libraries are found through
ECHO_PLUGIN_LIB / ECHO_PLUGIN_HOST_LIB or in plugins/build/ of the source tree, loaded once (functools.cache).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from echo_trtllm.core import budget as core_budget
from echo_trtllm.core import gating as core_gating
from echo_trtllm.core import prices as prices_mod
from echo_trtllm.core.budget import BudgetAllocation
from echo_trtllm.core.pack import PackedVerifyBatch, words_per_row
from echo_trtllm.core.pack import pack as core_pack
from echo_trtllm.core.tree import SuperTree
from echo_trtllm.core.verify import AcceptedPaths

__all__ = ["BACKENDS", "load_library", "backend_for", "host_allocator", "host_estimate_reader",
           "host_acceptance_refitter", "host_row_copier", "host_level_replayer",
           "host_selector", "host_acceptance_counter", "host_tree_builder", "host_isotonic",
           "host_kalman_stepper", "host_tree_selector", "host_draft_resulter", "host_greedy_acceptor",
           "host_greedy_logits_acceptor",
           "install_host", "gate", "allocate_budget", "pack", "PluginError"]

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "host", "cuda")
ABI_VERSION = 2  # plugins/include/echo/echo_abi.h's ECHO_ABI_VERSION: a library of another version is not loaded
BUILD_DIR = Path(__file__).resolve().parents[2] / "plugins" / "build"
_LIB_NAMES = {"cuda": ("ECHO_PLUGIN_LIB", "libecho_plugin.so"), "host": ("ECHO_PLUGIN_HOST_LIB", "libecho_host.so")}

_i32, _f32, _u8, _vp = ctypes.c_int32, ctypes.c_float, ctypes.c_uint8, ctypes.c_void_p


class PluginError(RuntimeError):
    """A plugin call returned an error; the message is the library's (what was wrong, what is accepted)."""


@functools.cache
def load_library(kind: str) -> ctypes.CDLL | None:
    """The plugin library of `kind` ("cuda" or "host"), or None when it is not built."""
    if kind not in _LIB_NAMES:
        raise ValueError(f"library kind must be 'cuda' or 'host', got {kind!r}")
    env, name = _LIB_NAMES[kind]
    path = Path(os.environ[env]) if os.environ.get(env) else BUILD_DIR / name
    if not path.is_file():
        return None
    try:
        lib = ctypes.CDLL(str(path))
        version = lib.echo_abi_version()
    except (OSError, AttributeError) as e:  # not loadable here, or not this plugin: the core runs instead
        logger.warning("%s is not usable (%s): running the core's reference instead", path, e)
        return None
    if version != ABI_VERSION:  # a build of other sources (plugins/build/ is not versioned): rebuild it
        logger.warning("%s has ABI version %s, this package expects %s: running the core's reference instead "
                       "(rebuild it: scripts/setup.sh)", path, version, ABI_VERSION)
        return None
    lib.echo_last_error.restype = ctypes.c_char_p  # every other entry point returns int (ctypes' default)
    if kind == "cuda" and not lib.echo_has_cuda():
        return None
    return lib


def backend_for(device: torch.device | str) -> str:
    """"cuda" for a CUDA device with the plugin built, "host" for the CPU with the host library built, otherwise
    the core reference ("torch")."""
    device = torch.device(device)
    if device.type == "cuda":
        return "cuda" if load_library("cuda") is not None else "torch"
    return "host" if device.type == "cpu" and load_library("host") is not None else "torch"


def host_allocator():
    """The budget allocation for trees on the host (the runtime's, after the drafting loop's last read): the host
    build's where `backend_for("cpu")` picks it, else the core's. Install it as a policy's `allocator`."""
    backend = backend_for("cpu")
    return core_budget.allocate_budget if backend == "torch" else functools.partial(allocate_budget, backend=backend)


def install_host(policy, step_cost=None) -> None:
    """The policy's control plane on the host library where it is built (the runtime's drafted trees are on the
    host): its budget allocation (`host_allocator`), the Super-Tree built from the drafted levels
    (`host_tree_builder`) and its selected sub-tree (`host_tree_selector`) and, for the echo family, its acceptance
    estimates' read (`host_estimate_reader`), counts' update (`host_acceptance_counter`) and refit
    (`host_acceptance_refitter`), its replay of drafted
    levels (`host_level_replayer`), its selection (`host_selector`) and the whole drafting result in one call
    (`host_draft_resulter`); with step_cost (a `core.prices.StepCostModel`),
    its two filters' steps (`host_kalman_stepper`)."""
    if step_cost is not None:
        step_cost.drafting.stepper = step_cost.verification.stepper = host_kalman_stepper()
    policy.allocator = host_allocator()
    acceptance = getattr(policy, "acceptance", None)
    if acceptance is not None:
        acceptance.reader = host_estimate_reader()
        acceptance.counter = host_acceptance_counter()
        acceptance.isotonic = host_isotonic()
        acceptance.refitter = host_acceptance_refitter()
    if hasattr(policy, "level_replayer"):
        policy.level_replayer = host_level_replayer()
    policy.tree_builder = host_tree_builder()
    policy.tree_selector = host_tree_selector()
    if hasattr(policy, "selector"):
        policy.selector = host_selector()
        if policy.selector is not None:  # it allocates as this allocator does; a policy given another one skips it
            policy.selector.allocator = policy.allocator
        policy.draft_resulter = host_draft_resulter()
        if policy.draft_resulter is not None:  # it builds and cuts the tree as these do; a policy given others skips it
            policy.draft_resulter.tree_builder = policy.tree_builder
            policy.draft_resulter.tree_selector = policy.tree_selector


def host_estimate_reader():
    """The online acceptance estimates' read on the host library (`OnlineAcceptance.reader`: the fit's compiled
    segments, one call for all nodes), or None where the library is not built (or predates it): the estimates are
    then read with NumPy, with the same results. The runtime installs it beside `host_allocator`."""
    return _host_entry("echo_acceptance_estimate_host", _estimate_host)


def host_acceptance_counter():
    """The online acceptance counts' update over a verified tree on the host library (`OnlineAcceptance.counter`:
    one call for `observe_nodes`), or None where the library is not built (or predates it). `install_host`
    installs it."""
    return _host_entry("echo_acceptance_observe_host", _observe_host)


def _observe_host(lib, online, depths: Tensor, confidences: Tensor, greedy: Tensor, accepted_node_ids: Tensor) -> None:
    """`echo_acceptance_observe_host` on an `OnlineAcceptance`'s counts (updated in place)."""
    depths = depths.cpu().long().contiguous()
    conf = confidences.detach().cpu().float().contiguous()  # path probabilities are float32 (the ABI's type)
    greedy = greedy.cpu().to(torch.uint8).contiguous()
    ids = accepted_node_ids.cpu().long().contiguous()
    if conf.numel() != depths.numel() or greedy.numel() != depths.numel():
        raise ValueError(f"acceptance_observe: depths, confidences and greedy need one entry per node, got "
                         f"{depths.numel()}, {conf.numel()}, {greedy.numel()}")
    cells = 2 * online.max_depth * (online.edges.numel() - 1)
    for t in (online.n, online.k, online.csum):
        if t.dtype != torch.float64 or not t.is_contiguous() or t.numel() != cells:
            raise ValueError(f"acceptance_observe: the counts must be contiguous float64 of {cells} cells")
    _check(lib, lib.echo_acceptance_observe_host(
        _ptr(depths), _ptr(conf), _ptr(greedy), _i32(depths.numel()), _ptr(ids), _i32(ids.numel()),
        _i32(online.max_depth), _ptr(online.edges), _i32(online.edges.numel() - 1), ctypes.c_double(online.decay),
        _ptr(online.n), _ptr(online.k), _ptr(online.csum)))


def host_tree_builder():
    """`SuperTree.from_levels` on the host library (`TreePolicy.tree_builder`: one call where the core makes about
    thirty tensor operations), or None where the library is not built (or predates it). `install_host` installs
    it."""
    return _host_entry("echo_tree_from_levels_host", _tree_from_levels_host)


def _tree_from_levels_host(lib, levels: list) -> SuperTree:
    """`echo_tree_from_levels_host` over drafted levels on the host (the core's `from_levels` is its oracle, and
    builds the tree for levels that are not the drafting loop's own: on a device, or of other dtypes)."""
    level_arrays = _level_arrays(levels, "tree_from_levels")
    if level_arrays is None:
        return SuperTree.from_levels(levels)
    sizes, req, par, tok, dprob, pprob, rank = level_arrays
    n, b = req.numel(), levels[0].num_nodes
    ints = torch.empty(7, n, dtype=torch.long)  # token, parent, depth, rank, source, request, global parent
    floats = torch.empty(2, n, dtype=torch.float32)
    cu = torch.empty(b + 1, dtype=torch.long)
    greedy = torch.empty(n, dtype=torch.bool)
    _check(lib, lib.echo_tree_from_levels_host(
        _ptr(sizes), _i32(len(levels)), _ptr(req), _ptr(par), _ptr(tok), _ptr(dprob), _ptr(pprob), _ptr(rank),
        _ptr(ints[0]), _ptr(ints[1]), _ptr(ints[2]), _ptr(floats[0]), _ptr(floats[1]), _ptr(ints[3]), _ptr(cu),
        _ptr(ints[4]), _ptr(ints[5]), _ptr(ints[6]), _ptr(greedy)))
    return _tree_of(ints, floats, cu, greedy, n)


def _level_arrays(levels: list, who: str):
    """The drafted levels' arrays as the library reads them, concatenated: (sizes, request, parent, token, draft
    prob, path prob, rank), checked; None where a level is not the drafting loop's own (on a device, or of other
    dtypes)."""
    if not levels or levels[0].depth != 0:
        raise ValueError("levels must start with the root level (depth 0) from root_level()")
    for d, lv in enumerate(levels):
        fields = (lv.request_ids, lv.parent_ids, lv.token_ids, lv.ranks, lv.draft_probs, lv.path_probs)
        if lv.depth != d:
            raise ValueError(f"{who}: level {d} has depth {lv.depth}; levels go 0, 1, 2, ...")
        if any(t.ndim != 1 or t.numel() != lv.num_nodes for t in fields):
            raise ValueError(f"{who}: level {d}'s fields must be 1-D with one entry per node "
                             f"({lv.num_nodes}), got shapes {[tuple(t.shape) for t in fields]}")
        if (any(t.device.type != "cpu" for t in fields) or any(t.dtype != torch.long for t in fields[:4])
                or any(t.dtype != torch.float32 for t in fields[4:])):
            return None
    sizes = torch.tensor([lv.num_nodes for lv in levels], dtype=torch.long)
    return (sizes, *(torch.cat([getattr(lv, f) for lv in levels]) for f in
                     ("request_ids", "parent_ids", "token_ids", "draft_probs", "path_probs", "ranks")))


def host_draft_resulter():
    """A step's drafting result on the host library in one call (`EchoPolicy.draft_resulter`): the Super-Tree of the
    drafted levels, the echo policy's selection (allocation and budget rule), the selected sub-tree and its packed
    verification batch, where `host_tree_builder`, `host_selector`, `host_tree_selector` and `pack` are four calls;
    None where the library is not built (or predates it). `install_host` installs it."""
    return _host_entry("echo_draft_result_host", _draft_result_host)


def _draft_result_host(lib, levels: list, spine_depth: Tensor, budget: int, max_nodes_per_request: int | None,
                       table: dict, max_depth: int, seconds: Tensor, context_lengths: Tensor, min_taken: int = 0):
    """`echo_draft_result_host` (echo_abi.h) over drafted levels on the host: (candidates, allocation, selected,
    packed), or None where the levels are not the drafting loop's own (then the four calls run). min_taken: the
    selection's floor of taken nodes where the budget rule takes none (a probe's, `allocate_budget`'s choose). Its
    oracles are the four: `_tree_from_levels_host`, `allocate_budget(..., choose=)`, `_tree_select_host` and `pack`
    (tests/plugins/test_echo_host.py)."""
    level_arrays = _level_arrays(levels, "draft_result")
    if level_arrays is None:
        return None
    sizes, req, par, tok, dprob, pprob, rank = level_arrays
    n, b = req.numel(), levels[0].num_nodes
    if spine_depth.shape != (b,) or context_lengths.shape != (b,):
        raise ValueError(f"draft_result: spine_depth and context_lengths need one entry per request ({b}), got "
                         f"{tuple(spine_depth.shape)} and {tuple(context_lengths.shape)}")
    spine = spine_depth.to(torch.int32).contiguous()
    ctx = context_lengths.to(torch.int32).contiguous()
    seconds = seconds.double().contiguous()
    tree_ints, tree_floats = torch.empty(7, n, dtype=torch.long), torch.empty(2, n, dtype=torch.float32)
    sel_ints, sel_floats = torch.empty(7, n, dtype=torch.long), torch.empty(2, n, dtype=torch.float32)
    tree_cu, sel_cu = torch.empty(b + 1, dtype=torch.long), torch.empty(b + 1, dtype=torch.long)
    tree_greedy, sel_greedy = torch.empty(n, dtype=torch.bool), torch.empty(n, dtype=torch.bool)
    selected, phase = torch.empty(n, dtype=torch.bool), torch.empty(n, dtype=torch.int8)
    num_nodes, order = torch.empty(b, dtype=torch.int32), torch.empty(max(n, 1), dtype=torch.int32)
    positions = torch.empty(2, n, dtype=torch.long)  # input ids, position ids
    packed_ints = torch.empty(2 * b + 1 + 2 * n, dtype=torch.int32)
    # the packing's outputs for the most the selection can keep: M <= min(N, budget) nodes, a request's n_max <= its
    # root and budget - B more, and at most max_nodes_per_request (the library checks the sizes it writes)
    rows = min(n, budget)
    widest = min(n, budget - b + 1, max_nodes_per_request or n)
    offsets = torch.empty(b * widest, dtype=torch.int32)
    mask = torch.empty(rows * words_per_row(widest), dtype=torch.int32)
    order_len, m, n_max = _i32(0), ctypes.c_int64(0), _i32(0)
    _check(lib, lib.echo_draft_result_host(
        _ptr(sizes), _i32(len(levels)), _ptr(req), _ptr(par), _ptr(tok), _ptr(dprob), _ptr(pprob), _ptr(rank),
        _ptr(spine), _i32(budget), _i32(max_nodes_per_request or 0), ctypes.byref(_host_segments(table)[4]),
        _i32(max_depth), _ptr(seconds), _i32(seconds.numel()), _i32(min_taken), _ptr(ctx), _ptr(tree_ints),
        _ptr(tree_floats), _ptr(tree_cu), _ptr(tree_greedy), _ptr(selected), _ptr(phase), _ptr(num_nodes), _ptr(order),
        ctypes.byref(order_len), _ptr(sel_ints), _ptr(sel_floats), _ptr(sel_greedy), _ptr(sel_cu), ctypes.byref(m),
        _ptr(positions[0]), _ptr(positions[1]), _ptr(packed_ints), _ptr(offsets), ctypes.c_int64(offsets.numel()),
        _ptr(mask), ctypes.c_int64(mask.numel()), ctypes.byref(n_max)))
    k, w = m.value, words_per_row(n_max.value)
    candidates = _tree_of(tree_ints, tree_floats, tree_cu, tree_greedy, n)
    chosen = _tree_of(sel_ints, sel_floats, sel_cu, sel_greedy, k)
    allocation = BudgetAllocation(selected, phase, num_nodes.long(), order[:order_len.value].long())
    cu, lengths = packed_ints[:b + 1], packed_ints[b + 1:2 * b + 1]
    packed = PackedVerifyBatch(
        input_ids=positions[0, :k], position_ids=positions[1, :k], parents=packed_ints[2 * b + 1:2 * b + 1 + k],
        node_depths=packed_ints[2 * b + 1 + k:2 * b + 1 + 2 * k], cu_num_nodes=cu, generation_lengths=lengths,
        position_offsets=offsets[:b * n_max.value].view(b, n_max.value), packed_mask=mask[:k * w].view(k, w))
    return candidates, allocation, chosen, packed


def _tree_of(ints: Tensor, floats: Tensor, cu: Tensor, greedy: Tensor | None, k: int) -> SuperTree:
    """A SuperTree of the first k columns of the host library's (7, N) int64 rows (token, parent, depth, rank,
    source, request, global parent) and (2, N) float32 rows (draft and path probabilities), with its derived
    request ids, global parents and (where given) greedy flags filled."""
    ints, floats = ints[:, :k], floats[:, :k]
    tree = SuperTree(token_ids=ints[0], parents=ints[1], depths=ints[2], draft_probs=floats[0], path_probs=floats[1],
                     ranks=ints[3], cu_num_nodes=cu, source_index=ints[4])
    tree.__dict__.update(request_ids=ints[5], global_parents=ints[6])
    if greedy is not None:
        tree.__dict__["on_greedy_path"] = greedy[:k]
    return tree


def host_tree_selector():
    """`SuperTree.select` on the host library (`TreePolicy.tree_selector`: one call where the core makes about
    twenty-five tensor operations), or None where the library is not built (or predates it). `install_host`
    installs it."""
    return _host_entry("echo_tree_select_host", _tree_select_host)


def _tree_select_host(lib, tree: SuperTree, mask: Tensor) -> SuperTree:
    """`echo_tree_select_host` (the core's `SuperTree.select` is its oracle, and selects where the tree or the mask
    is not the drafting loop's own: on a device, of other dtypes, or a mask of another shape, which it refuses). A
    mask that drops a root or orphans a node raises `PluginError` with the core's words (the core: ValueError)."""
    n = tree.total_nodes
    ints = (tree.token_ids, tree.depths, tree.ranks, tree.source_index, tree.cu_num_nodes)
    if (mask.shape != (n,) or mask.dtype != torch.bool or mask.device.type != "cpu"
            or any(t.device.type != "cpu" or t.dtype != torch.long for t in ints)
            or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in (tree.draft_probs, tree.path_probs))):
        return tree.select(mask)
    req, gp = tree.request_ids.contiguous(), tree.global_parents.contiguous()
    greedy = tree.__dict__.get("on_greedy_path")
    if (any(t.device.type != "cpu" or t.dtype != torch.long or t.shape != (n,) for t in (req, gp))
            or (greedy is not None and (greedy.device.type != "cpu" or greedy.dtype != torch.bool))):
        return tree.select(mask)  # derived tensors of other dtypes (levels the core built)
    greedy = greedy.contiguous().view(torch.uint8) if greedy is not None else None
    b = tree.batch_size
    out_ints = torch.empty(7, n, dtype=torch.long)  # token, parent, depth, rank, source, request, global parent
    out_floats = torch.empty(2, n, dtype=torch.float32)
    out_greedy = torch.empty(n, dtype=torch.bool) if greedy is not None else None
    cu = torch.empty(b + 1, dtype=torch.long)
    m = ctypes.c_int64(0)
    c = [t.contiguous() for t in (mask.view(torch.uint8), tree.token_ids, tree.depths, tree.draft_probs,
                                  tree.path_probs, tree.ranks, tree.source_index)]
    _check(lib, lib.echo_tree_select_host(
        ctypes.c_int64(n), ctypes.c_int64(b), _ptr(c[0]), _ptr(req), _ptr(gp), _ptr(c[1]), _ptr(c[2]), _ptr(c[3]),
        _ptr(c[4]), _ptr(c[5]), _ptr(c[6]), _ptr(greedy), ctypes.byref(m), _ptr(out_ints[0]), _ptr(out_ints[1]),
        _ptr(out_ints[2]), _ptr(out_floats[0]), _ptr(out_floats[1]), _ptr(out_ints[3]), _ptr(out_ints[4]),
        _ptr(out_ints[5]), _ptr(out_ints[6]), _ptr(out_greedy), _ptr(cu)))
    return _tree_of(out_ints, out_floats, cu, out_greedy, m.value)


def host_isotonic():
    """The online acceptance refit's isotonic fits of every row in one call on the host library
    (`OnlineAcceptance.isotonic`), or None where the library is not built (or predates it). `install_host`
    installs it."""
    return _host_entry("echo_isotonic_rows_host", _isotonic_host)


def _isotonic_host(lib, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """`echo_isotonic_rows_host` of each row of y (rows, cols) with weights w (the core's
    `_weighted_isotonic` per row is its oracle)."""
    y = np.ascontiguousarray(y, dtype=np.float64)
    w = np.ascontiguousarray(w, dtype=np.float64)
    if y.ndim != 2 or w.shape != y.shape:
        raise ValueError(f"isotonic: y and w must be (rows, cols) of one shape, got {y.shape} and {w.shape}")
    out = np.empty_like(y)
    _check(lib, lib.echo_isotonic_rows_host(_vp(y.ctypes.data), _vp(w.ctypes.data), _i32(y.shape[0]),
                                            _i32(y.shape[1]), _vp(out.ctypes.data)))
    return out


def host_acceptance_refitter():
    """The online acceptance refit without a calibration on the host library (`OnlineAcceptance.refitter`: the fit,
    its compiled segments and the gate's threshold grids in one call, where NumPy takes about a hundred array
    operations), or None where the library is not built (or predates it). `install_host` installs it."""
    return _host_entry("echo_acceptance_refit_host", _refit_host)


def _refit_host(lib, n: np.ndarray, k: np.ndarray, csum: np.ndarray, mid: np.ndarray, p0: np.ndarray,
                edges: np.ndarray, prior_weight: float, grid: np.ndarray):
    """`echo_acceptance_refit_host` on the counts, bins' middles and priors (each (2 max_depth, bins) float64):
    (fit (3, rows, bins): centres, values, p0; segments (7, rows * 2 bins): keys, start, l0, l1, share, e0, e1;
    grid estimates (max_depth, grid size)), views of one new buffer. `OnlineAcceptance._fit` and `_segments_table`
    with NumPy are its oracle (tests/plugins/test_acceptance_host.py)."""
    rows, bins = n.shape
    arrays = [np.ascontiguousarray(a, dtype=np.float64) for a in (n, k, csum, mid, p0, edges, grid)]
    if rows % 2 or any(a.shape != (rows, bins) for a in arrays[:5]) or arrays[5].shape != (bins + 1,):
        raise ValueError(f"acceptance_refit: n, k, csum, mid and p0 must be (2 max_depth, bins) with edges of "
                         f"bins + 1, got {[a.shape for a in arrays[:6]]}")
    cells, segs, depth, g = rows * bins, rows * 2 * bins, rows // 2, arrays[6].size
    out = np.empty(3 * cells + 7 * segs + depth * g)
    _check(lib, lib.echo_acceptance_refit_host(
        *(_vp(a.ctypes.data) for a in arrays[:5]), _i32(depth), _vp(arrays[5].ctypes.data), _i32(bins),
        ctypes.c_double(prior_weight), _vp(arrays[6].ctypes.data), _i32(g), _vp(out.ctypes.data),
        _vp(out.ctypes.data + 8 * 3 * cells), _vp(out.ctypes.data + 8 * (3 * cells + 7 * segs))))
    return (out[:3 * cells].reshape(3, rows, bins), out[3 * cells:3 * cells + 7 * segs].reshape(7, segs),
            out[3 * cells + 7 * segs:].reshape(depth, g))


def host_row_copier():
    """Rows of one CPU table copied into another by index in one call on the host library (`Eagle3Drafter.row_copier`:
    the verification forward's rows of the accepted tokens straight into the feature store, where torch gathers them
    then copies them again), or None where the library is not built (or predates it). The executor installs it where
    the target runs on the CPU."""
    return _host_entry("echo_copy_rows_host", _copy_rows_host)


def _copy_rows_host(lib, dst: Tensor, dst_index: Tensor, src: Tensor, src_index: Tensor | None = None) -> None:
    """dst[dst_index[i]] = src[src_index[i]] (src_index None: src[i]) by `echo_copy_rows_host`; dst and src 2-D CPU
    tensors of one dtype and width, rows contiguous; the indices CPU int64. `dst.index_copy_(0, dst_index,
    src[src_index])` is its oracle (tests/plugins/test_echo_host.py)."""
    n = dst_index.numel()
    if (dst.dim() != 2 or src.dim() != 2 or dst.dtype != src.dtype or dst.shape[1] != src.shape[1]
            or dst.device.type != "cpu" or src.device.type != "cpu" or dst.stride(1) != 1 or src.stride(1) != 1):
        raise ValueError(f"copy_rows: dst and src must be 2-D CPU tensors of one dtype and width with contiguous rows, "
                         f"got {tuple(dst.shape)} {dst.dtype} on {dst.device} and {tuple(src.shape)} {src.dtype} on "
                         f"{src.device}")
    indices = [t for t in (dst_index, src_index) if t is not None]
    if any(t.dtype != torch.long or t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous() for t in indices):
        raise ValueError("copy_rows: dst_index and src_index must be 1-D contiguous CPU int64 tensors")
    if (src_index.numel() if src_index is not None else src.shape[0]) != n:
        raise ValueError(f"copy_rows: {n} destination rows for "
                         f"{src_index.numel() if src_index is not None else src.shape[0]} source rows")
    size = dst.element_size()
    _check(lib, lib.echo_copy_rows_host(
        _ptr(dst), ctypes.c_int64(dst.shape[0]), ctypes.c_int64(dst.stride(0) * size), _ptr(dst_index), _ptr(src),
        ctypes.c_int64(src.shape[0]), ctypes.c_int64(src.stride(0) * size), _ptr(src_index), ctypes.c_int64(n),
        ctypes.c_int64(dst.shape[1] * size)))


def host_kalman_stepper():
    """A step-price filter's step (`KalmanLinear.step`: the drift, the update and the projection onto costs >= 0)
    in one call on the host library (`KalmanLinear.stepper`), or None where the library is not built (or predates
    it): the NumPy code then runs, its oracle. `install_host` installs it on a `StepCostModel`'s two filters."""
    return _host_entry("echo_kalman_step_host", _kalman_step_host)


def _kalman_step_host(lib, kf, phi: np.ndarray, y: float, channel: int = 0) -> float:
    """`echo_kalman_step_host` on a `KalmanLinear` (theta, cov and the channel's noise updated in place; its step
    and update counts and last noise variance as its own `advance` and `update` keep them)."""
    n = kf.theta.size
    phi = np.ascontiguousarray(phi, dtype=np.float64)
    arrays = (kf.theta, kf.cov, kf._cap, kf._floor)
    if (phi.shape != (n,) or kf.cov.shape != (n, n)
            or any(a.dtype != np.float64 or not a.flags.c_contiguous for a in arrays)):
        raise ValueError(f"kalman_step: phi must be ({n},) and the filter's theta, cov, cap and floor contiguous "
                         f"float64 of n = {n}, got phi {phi.shape}, cov {kf.cov.shape}")
    noise = (ctypes.c_double * 1)(kf.noise[channel])  # an unknown channel raises before anything moves
    every = prices_mod.DRIFT_EVERY
    kf.steps += 1
    drift = kf.steps % every == 0
    out = (ctypes.c_double * 2)()
    _check(lib, lib.echo_kalman_step_host(
        _i32(n), _vp(kf.theta.ctypes.data), _vp(kf.cov.ctypes.data), _vp(phi.ctypes.data), ctypes.c_double(y),
        _vp(kf._cap.ctypes.data), _vp(kf._floor.ctypes.data), ctypes.c_double(every * kf.drift_common ** 2),
        ctypes.c_double(every * kf.drift_each ** 2), _i32(drift), ctypes.c_double(kf.huber), noise,
        ctypes.c_double(kf.noise_floor), ctypes.c_double(kf.noise_rate), ctypes.c_double(prices_mod.MIN_SECONDS),
        out))
    kf.noise[channel] = noise[0]
    kf.last_noise_var = out[1]
    kf.updates += 1
    return out[0]


def host_selector():
    """The echo policy's selection on the host library (`EchoPolicy.selector`: the budget allocation and the budget
    rule in one call, `allocate_budget(..., choose=...)`), or None where the library is not built (or predates it).
    `install_host` installs it."""
    return _host_entry("echo_select_host", lambda lib: functools.partial(allocate_budget, backend="host"), bind=False)


def host_level_replayer():
    """The drafted levels' replay with the echo policy's decisions on the host library (`EchoPolicy.level_replayer`:
    one call per level for `core.policies._replay`'s loop body and the policy's gate, budget stop and cost stop's
    tokens), or None where the library is not built (or predates it): the levels are then replayed in torch, with
    the same results. `install_host` installs it."""
    replayer = _host_entry("echo_replay_level_host", _replay_level_host)
    if replayer is not None:  # whether it can also choose the next level's frontier (next_width=): newer builds
        replayer.next_frontier = hasattr(_lib("host"), "echo_replay_level_next_host")
    return replayer


def host_greedy_acceptor():
    """Greedy verification's acceptance on the host library (`core.verify.verify_paths`' acceptor: the accepted
    path of every request and its bonus token in one call, where `_accept_predicted` takes about twenty tensor
    operations and the batch's flat parents), or None where the library is not built (or predates it): the runtime
    then accepts in torch, with the same results. The runtime passes it where the target runs on the CPU."""
    return _host_entry("echo_accept_greedy_host", _accept_greedy_host)


def _accept_greedy_host(lib, batch: PackedVerifyBatch, pred: Tensor, max_depth: int | None) -> AcceptedPaths:
    """`echo_accept_greedy_host` (echo_abi.h) on a packed batch on the host; `core.verify._accept_predicted` is its
    oracle (tests/plugins/test_greedy_accept_host.py). pred (N_tot,): the target's top-1 after each node; max_depth:
    the tree's deepest depth (None: read from the batch), the paths' width less one."""
    n = batch.total_nodes
    if pred.shape != (n,) or pred.device.type != "cpu":
        raise ValueError(f"accept_greedy: pred must be one CPU entry per node ({n}), got {tuple(pred.shape)} on "
                         f"{pred.device}")
    tree, paths = _greedy_tree(batch, max_depth, "accept_greedy")
    ids, parents, depths, cu, b, n, width = tree
    _check(lib, lib.echo_accept_greedy_host(_ptr(ids), _ptr(pred.long().contiguous()), _ptr(parents), _ptr(depths),
                                            _ptr(cu), _i32(b), _i32(n), _i32(width), *(_ptr(t) for t in paths)))
    return AcceptedPaths(*paths)


def _greedy_tree(batch: PackedVerifyBatch, max_depth: int | None, who: str):
    """The greedy acceptors' shared arguments: the packed batch's arrays as the library reads them, checked (on the
    CPU, one entry per node or cu's B + 1), and its outputs. Returns ((input_ids, parents, depths, cu, B, N, width),
    (nodes, tokens, counts)); width = max_depth + 1 (max_depth None: the batch's deepest)."""
    n, b = batch.total_nodes, batch.batch_size
    for name, t, size in (("input_ids", batch.input_ids, n), ("parents", batch.parents, n),
                          ("node_depths", batch.node_depths, n), ("cu_num_nodes", batch.cu_num_nodes, b + 1)):
        if t.shape != (size,) or t.device.type != "cpu":  # the library reads these lengths from n and b
            raise ValueError(f"{who}: the batch's {name} must be {size} entries on the CPU, got "
                             f"{tuple(t.shape)} on {t.device}")
    depths = batch.node_depths.to(torch.int32).contiguous()
    if max_depth is None:
        max_depth = int(depths.max()) if n else 0
    ids = batch.input_ids.long().contiguous()
    parents, cu = batch.parents.to(torch.int32).contiguous(), batch.cu_num_nodes.to(torch.int32).contiguous()
    paths = (torch.empty(b, max_depth + 1, dtype=torch.long), torch.empty(b, max_depth + 1, dtype=torch.long),
             torch.empty(b, dtype=torch.long))
    return (ids, parents, depths, cu, b, n, max_depth + 1), paths


def host_greedy_logits_acceptor():
    """Greedy verification's acceptance reading the target's logits on the host library (`core.verify.verify_paths`'
    reader): the top-1 of a node's row is read only where the walk needs it (after a node on an accepted path, and
    at each request's last accepted node), where the runtime otherwise takes every verified row's argmax first; None
    where the library is not built (or predates it). The runtime passes it where the target runs on the CPU."""
    return _host_entry("echo_accept_greedy_logits_host", _accept_greedy_logits_host)


_LOGIT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _accept_greedy_logits_host(lib, batch: PackedVerifyBatch, logits: Tensor, max_depth: int | None,
                               pred: Tensor | None = None) -> AcceptedPaths | None:
    """`echo_accept_greedy_logits_host` (echo_abi.h) on a packed batch and its (N_tot, V) logits on the host, or None
    where the logits are not float32 / bfloat16 CPU rows (the caller then takes the argmax of every row). `verify_paths`
    with `_accept_predicted` over `row_argmax` is its oracle (tests/plugins/test_greedy_accept_host.py). pred: an
    (N_tot,) int64 CPU tensor the rows' top-1 are written to, -1 for the rows never read (tests, measurements)."""
    n = batch.total_nodes
    if (logits.ndim != 2 or logits.shape[0] != n or logits.device.type != "cpu" or logits.dtype not in _LOGIT_DTYPES
            or logits.shape[1] < 1 or logits.stride(1) != 1 or (n > 1 and logits.stride(0) < logits.shape[1])):
        return None  # not rows of one vocabulary each, one after another (overlapping rows: an expanded tensor)
    tree, paths = _greedy_tree(batch, max_depth, "accept_greedy_logits")
    ids, parents, depths, cu, b, n, width = tree
    if pred is None:
        pred = torch.empty(n, dtype=torch.long)
    elif pred.shape != (n,) or pred.dtype != torch.long or pred.device.type != "cpu" or not pred.is_contiguous():
        raise ValueError(f"accept_greedy_logits: pred must be a contiguous int64 CPU tensor of one entry per node "
                         f"({n}), got {pred.dtype} {tuple(pred.shape)} on {pred.device}")
    _check(lib, lib.echo_accept_greedy_logits_host(
        _ptr(logits), ctypes.c_int64(logits.stride(0) if n > 1 else logits.shape[1]), ctypes.c_int64(logits.shape[1]),
        _i32(_LOGIT_DTYPES[logits.dtype]), _ptr(ids), _ptr(parents), _ptr(depths), _ptr(cu), _i32(b), _i32(n),
        _i32(width), *(_ptr(t) for t in paths), _ptr(pred)))
    return AcceptedPaths(*paths)


def _host_entry(symbol: str, fn, bind: bool = True):
    """fn with the host library as its first argument (bind=False: fn(lib) is the entry), where `backend_for`
    picks the host library and it has `symbol`; None otherwise (not built, or a build that predates the symbol)."""
    if backend_for("cpu") != "host":
        return None
    lib = _lib("host")
    if not hasattr(lib, symbol):
        return None
    return functools.partial(fn, lib) if bind else fn(lib)


_SEGMENT_ARRAYS = ("keys", "start", "l0", "l1", "share", "e0", "e1")


class _Segments(ctypes.Structure):
    """echo_abi.h's echo_segments."""

    _fields_ = [(k, _vp) for k in _SEGMENT_ARRAYS] + [("num_segments", _i32), ("deep", _vp), ("num_rows", _i32)]


def _host_segments(table: dict) -> tuple:
    """One compiled fit's arrays marshalled for the library, once per fit (kept in table["host"]): (arrays, deep,
    their pointers, deep's pointer, the echo_segments struct)."""
    if table.get("host") is None:
        arrays = [np.ascontiguousarray(table[k], dtype=np.float64) for k in _SEGMENT_ARRAYS]
        deep = None if table["deep"] is None else np.ascontiguousarray(table["deep"], dtype=np.uint8)
        ptrs = [_vp(a.ctypes.data) for a in arrays]
        deep_ptr = _vp(0) if deep is None else _vp(deep.ctypes.data)
        struct = _Segments(*[a.ctypes.data for a in arrays], arrays[0].size,
                           None if deep is None else deep.ctypes.data, table["rows"])
        table["host"] = (arrays, deep, ptrs, deep_ptr, struct)
    return table["host"]


def _replay_level_host(lib, prev_request_ids: Tensor, prev_path_probs: Tensor, prev_slots: Tensor, slot_width: int,
                       front: Tensor, fvalid: Tensor, probs: Tensor, tokens: Tensor, row_of: Tensor, depth: int,
                       tau: float | None, budget_spare: int | None, table: dict | None, gain_row: int,
                       active: Tensor, spine_depth: Tensor, failed_at: Tensor, history: Tensor,
                       parent_path: Tensor | None = None, next_width: int = 0):
    """`echo_replay_level_host` (echo_abi.h) on host tensors. spine_depth and failed_at (int64) are updated in place
    and history's row depth - 1 is written. budget_spare None: no budget stop; table: the acceptance fit for the
    cost stop's tokens (None: not read). Returns (slot of each previous node in the frontier (-1: not expanded),
    the new level's (request, parent, token, rank, slot) int64 and (draft prob, path prob) float32 as tensors of
    its nodes, the new active mask, active requests, claimed tokens, the active requests' estimated tokens, the
    next level). next_width >= 1: `echo_replay_level_next_host` with parent_path (R, W), each frontier node's path
    probability on the device, and the next level is (rows kept, their frontier's slots, valid, path probabilities,
    tokens and parents' frontier slots, each (R kept, min(next_width, W K))); else the next level is None."""
    prev_request_ids, prev_slots = prev_request_ids.long().contiguous(), prev_slots.long().contiguous()
    prev_path_probs, row_of = prev_path_probs.float().contiguous(), row_of.long().contiguous()
    active = active.bool().contiguous()
    front = front.long().contiguous()
    fvalid = fvalid.to(torch.uint8).contiguous()
    probs = probs.float().contiguous()
    tokens = tokens.long().contiguous()
    m = prev_request_ids.numel()
    rows, width = front.shape
    k = probs.shape[-1]
    b = active.numel()
    # the shapes the library reads and writes by (it cannot see them)
    if (fvalid.shape != (rows, width) or probs.shape != (rows, width, k) or tokens.shape != probs.shape
            or prev_path_probs.numel() != m or prev_slots.numel() != m or row_of.numel() != b):
        raise ValueError(f"replay_level: front {tuple(front.shape)} needs fvalid (R, W), probs and tokens (R, W, K), "
                         f"got {tuple(fvalid.shape)}, {tuple(probs.shape)}, {tuple(tokens.shape)}; the previous "
                         f"level's arrays one entry per node ({m}), row_of one per request ({b})")
    for name, t, dtype in (("spine_depth", spine_depth, torch.long), ("failed_at", failed_at, torch.long),
                           ("history", history, torch.float32)):
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or t.shape[-1] != b:
            raise ValueError(f"replay_level: {name} must be a contiguous {dtype} CPU tensor of one entry per request "
                             f"({b}) in its last dimension, got {t.dtype} {tuple(t.shape)} on {t.device}")
    ints = torch.empty(5, m * k, dtype=torch.long)
    floats = torch.empty(2, m * k, dtype=torch.float32)
    slot_of = torch.empty(m, dtype=torch.long)
    active_out = torch.empty(b, dtype=torch.bool)
    nf, na, claimed, gain = _i32(0), _i32(0), ctypes.c_int64(0), ctypes.c_double(0.0)
    fit = None if table is None else ctypes.byref(_host_segments(table)[4])
    args = (_ptr(prev_request_ids), _ptr(prev_path_probs), _ptr(prev_slots), _i32(m), _i32(slot_width), _ptr(front),
            _ptr(fvalid), _ptr(probs), _ptr(tokens), _i32(rows), _i32(width), _i32(k), _ptr(row_of), _i32(b),
            _i32(depth), _i32(history.shape[0]), _i32(tau is not None), _f32(0.0 if tau is None else tau),
            _i32(budget_spare is not None), _i32(budget_spare or 0), fit, _i32(gain_row), _ptr(active),
            _ptr(active_out), _ptr(spine_depth), _ptr(failed_at), _ptr(history), _ptr(slot_of), _ptr(ints[0]),
            _ptr(ints[1]), _ptr(ints[2]), _ptr(floats[0]), _ptr(floats[1]), _ptr(ints[3]), _ptr(ints[4]),
            ctypes.byref(nf), ctypes.byref(na), ctypes.byref(claimed), ctypes.byref(gain))
    if next_width < 1:
        _check(lib, lib.echo_replay_level_host(*args))
        nxt = None
    else:
        nxt = _replay_level_next(lib, args, parent_path, next_width, rows, width, k)
    size = nf.value * k
    return (slot_of, ints[:, :size], floats[:, :size], active_out, na.value, claimed.value, gain.value, nxt)


def _replay_level_next(lib, args: tuple, parent_path: Tensor, next_width: int, rows: int, width: int, k: int):
    """`echo_replay_level_next_host` with `_replay_level_host`'s arguments: the next level (rows kept, front, fvalid,
    path probabilities, tokens, parents), None where drafting ended."""
    parent_path = parent_path.float().contiguous()
    if parent_path.shape != (rows, width):
        raise ValueError(f"replay_level: parent_path must be (R, W) = {(rows, width)} like front, got "
                         f"{tuple(parent_path.shape)}")
    w = min(next_width, width * k)
    keep, kept, slots = torch.empty(rows, dtype=torch.long), _i32(0), _i32(0)
    ints, path = torch.empty(3, rows, w, dtype=torch.long), torch.empty(rows, w, dtype=torch.float32)
    valid = torch.empty(rows, w, dtype=torch.bool)
    _check(lib, lib.echo_replay_level_next_host(
        *args, _ptr(parent_path), _i32(next_width), _ptr(keep), _ptr(ints[0]), _ptr(valid), _ptr(path), _ptr(ints[1]),
        _ptr(ints[2]), ctypes.byref(kept), ctypes.byref(slots)))
    r = kept.value
    return (keep[:r], ints[0, :r], valid[:r], path[:r], ints[1, :r], ints[2, :r]) if slots.value else None


def _estimate_host(lib, table: dict, confidences: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """`echo_acceptance_estimate_host` over one compiled fit (`OnlineAcceptance._segments_table`); the table's
    arrays are marshalled once per fit and kept in it (table["host"])."""
    arrays, _, ptrs, deep_ptr, _ = _host_segments(table)
    c = np.ascontiguousarray(confidences, dtype=np.float64)
    r = np.ascontiguousarray(rows, dtype=np.int32)
    out = np.empty(c.size, dtype=np.float64)
    _check(lib, lib.echo_acceptance_estimate_host(_vp(c.ctypes.data), _vp(r.ctypes.data), _i32(c.size), *ptrs,
                                                  _i32(arrays[0].size), deep_ptr, _i32(table["rows"]),
                                                  _vp(out.ctypes.data)))
    return out


def _lib(backend: str) -> ctypes.CDLL:
    lib = load_library(backend)
    if lib is None:
        env, name = _LIB_NAMES[backend]
        raise PluginError(f"the {backend} plugin library is not built: run `cmake -S plugins -B plugins/build && "
                          f"cmake --build plugins/build` (or set {env} to a {name})")
    return lib


def _check(lib: ctypes.CDLL, rc: int) -> None:
    if rc != 0:
        raise PluginError(lib.echo_last_error().decode() or f"plugin error code {rc}")


def _ptr(t: Tensor | None):
    """The tensor's data pointer; the caller keeps the tensor referenced until the call returns."""
    return _vp(t.data_ptr()) if t is not None else _vp(0)


def _stream(device: torch.device):
    return _vp(torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else None


def _resolve(backend: str | None, device: torch.device) -> str:
    backend = backend or backend_for(device)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "host" and device.type != "cpu":
        raise ValueError("backend 'host' runs on CPU tensors; move them to the CPU or use backend 'cuda'")
    if backend == "cuda" and device.type != "cuda":
        raise ValueError("backend 'cuda' needs CUDA tensors")
    return backend


def _workspace(lib, query: str, *sizes: int, device: torch.device) -> tuple[Tensor, int]:
    nbytes = ctypes.c_size_t(0)
    _check(lib, getattr(lib, query)(*[_i32(s) for s in sizes], ctypes.byref(nbytes)))
    return torch.empty(max(nbytes.value, 1), dtype=torch.uint8, device=device), nbytes.value


# ------------------------------------------------------------------------------------------------------ gate

def gate(path_probs: Tensor, request_ids: Tensor, batch_size: int, active: Tensor, tau: float,
         backend: str | None = None) -> tuple[Tensor, Tensor]:
    """Confidence c_i (max path probability of request i's level nodes, 0 if none) and passed = active & c > tau."""
    backend = _resolve(backend, path_probs.device)
    if backend == "torch":
        conf = core_gating.per_request_max(path_probs.float(), request_ids.long(), batch_size, fill=0.0)
        return conf, core_gating.gate(conf, tau, active.bool())
    lib = _lib(backend)
    dev = path_probs.device
    probs = path_probs.float().contiguous()
    req = request_ids.to(torch.int32).contiguous()
    act = active.to(torch.uint8).contiguous()
    conf = torch.empty(batch_size, dtype=torch.float32, device=dev)
    passed = torch.empty(batch_size, dtype=torch.uint8, device=dev)
    args = [_ptr(probs), _ptr(req), _ptr(act), _i32(probs.numel()), _i32(batch_size), _f32(tau), _ptr(conf),
            _ptr(passed)]
    _check(lib, lib.echo_gate_host(*args) if backend == "host" else lib.echo_gate_cuda(*args, _stream(dev)))
    return conf, passed.bool()


# ---------------------------------------------------------------------------------------------------- budget

def allocate_budget(tree: SuperTree, spine_depth: Tensor, budget: int, max_nodes_per_request: int | None = None,
                    backend: str | None = None, with_order: bool = True,
                    choose: tuple | None = None) -> BudgetAllocation:
    """echo_trtllm.core.budget.allocate_budget, on the chosen backend (equal results). with_order=False: the
    plugin's fused allocation (N <= 16384), which does not produce the taken order: `order` comes back empty and
    the other fields equal the core's. choose (host only): (acceptance fit table, its max depth, seconds (n,) of the
    step verifying n = 0, 1, ... more tokens[, min_taken]): the allocation cut by the budget rule in the same call,
    where the rule takes no node the first min_taken taken instead (a probe's floor; default 0)
    (`echo_select_host`; `core.cost.choose_budget`, the floor, then `BudgetAllocation.truncated` is its oracle)."""
    backend = _resolve(backend, tree.path_probs.device)
    if choose is not None and backend != "host":
        raise ValueError(f"choose= runs on the host library only, not on backend {backend!r}")
    if backend == "torch":
        return core_budget.allocate_budget(tree, spine_depth, budget, max_nodes_per_request)
    lib = _lib(backend)
    dev = tree.path_probs.device
    b, n = tree.batch_size, tree.total_nodes
    if budget < b:
        raise ValueError(f"budget K_max = {budget} is below the batch size {b}: every request needs its root")
    ins = [tree.path_probs.float().contiguous(), tree.depths.to(torch.int32).contiguous(),
           tree.parents.to(torch.int32).contiguous(), tree.cu_num_nodes.to(torch.int32).contiguous()]
    spine = spine_depth.to(device=dev, dtype=torch.int32).contiguous()
    # sentinels, not empty memory: an output a path fails to write cannot pass for another call's result
    selected = torch.full((n,), 2, dtype=torch.uint8, device=dev)
    phase = torch.full((n,), 9, dtype=torch.int8, device=dev)
    num_nodes = torch.full((b,), -1, dtype=torch.int32, device=dev)
    order = torch.empty(max(n - b, 1) if with_order else 0, dtype=torch.int32, device=dev)
    order_len = torch.full((1,), -1, dtype=torch.int32, device=dev)
    args = [*map(_ptr, ins), _i32(b), _i32(n), _ptr(spine), _i32(budget), _i32(max_nodes_per_request or 0),
            _ptr(selected), _ptr(phase), _ptr(num_nodes), _ptr(order if with_order else None), _ptr(order_len)]
    if choose is not None:
        if len(choose) not in (3, 4):
            raise ValueError(f"choose takes (table, max_depth, seconds[, min_taken]), got {len(choose)} entries")
        table, max_depth, seconds, *floor = choose
        greedy = tree.on_greedy_path.to(torch.uint8).contiguous()
        seconds = seconds.double().contiguous()
        _check(lib, lib.echo_select_host(*args, _ptr(greedy), ctypes.byref(_host_segments(table)[4]),
                                         _i32(max_depth), _ptr(seconds), _i32(seconds.numel()),
                                         _i32(floor[0] if floor else 0)))
    elif backend == "host":
        _check(lib, lib.echo_allocate_budget_host(*args))
    else:
        ws, nbytes = _workspace(lib, "echo_allocate_budget_workspace_bytes", n, b, device=dev)
        _check(lib, lib.echo_allocate_budget_cuda(*args, _ptr(ws), ctypes.c_size_t(nbytes), _stream(dev)))
    if bool((selected > 1).any() | (phase == 9).any() | (num_nodes < 0).any()) or int(order_len.item()) < 0:
        raise PluginError("allocate_budget: the plugin left an output unwritten")
    taken = order[: int(order_len.item())].long() if with_order else order.long()
    return BudgetAllocation(selected.bool(), phase, num_nodes.long(), taken)


# ------------------------------------------------------------------------------------------------------ pack

def pack(tree: SuperTree, context_lengths: Tensor | None = None, selected: Tensor | None = None,
         backend: str | None = None) -> PackedVerifyBatch:
    """core.pack(tree.select(selected), context_lengths) (selected None = every node), on the chosen backend."""
    backend = _resolve(backend, tree.token_ids.device)
    if backend == "torch":
        return core_pack(tree if selected is None else tree.select(selected), context_lengths)
    lib = _lib(backend)
    dev = tree.token_ids.device
    b, n = tree.batch_size, tree.total_nodes
    if context_lengths is not None and context_lengths.shape != (b,):
        raise ValueError(f"context_lengths must have shape ({b},), got {tuple(context_lengths.shape)}")
    sel = None if selected is None else selected.to(device=dev, dtype=torch.uint8).contiguous()
    counts = (torch.bincount(tree.request_ids[selected.to(dev).bool()], minlength=b) if selected is not None
              else tree.num_nodes)
    k, n_max = int(counts.sum()), int(counts.max())  # one device sync on CUDA: the output shapes
    w = words_per_row(n_max)
    i32 = {"dtype": torch.int32, "device": dev}
    cu_out, lengths = torch.empty(b + 1, **i32), torch.empty(b, **i32)
    src, parents, depths, pos = (torch.empty(k, **i32) for _ in range(4))
    offsets, mask = torch.empty(b, n_max, **i32), torch.empty(k, w, **i32)
    ctx = None if context_lengths is None else context_lengths.to(device=dev, dtype=torch.int32).contiguous()
    tree_parents = tree.parents.to(torch.int32).contiguous()  # named: the pointers must outlive the call
    tree_cu = tree.cu_num_nodes.to(torch.int32).contiguous()
    args = [_ptr(tree_parents), _ptr(tree_cu), _ptr(sel), _ptr(ctx), _i32(b), _i32(n), _i32(k), _i32(n_max), _ptr(cu_out), _ptr(lengths), _ptr(src),
            _ptr(parents), _ptr(depths), _ptr(pos), _ptr(offsets), _ptr(mask)]
    if backend == "host":
        _check(lib, lib.echo_pack_host(*args))
    else:
        ws, nbytes = _workspace(lib, "echo_pack_workspace_bytes", n, device=dev)
        _check(lib, lib.echo_pack_cuda(*args, _ptr(ws), ctypes.c_size_t(nbytes), _stream(dev)))
    return PackedVerifyBatch(
        input_ids=tree.token_ids[src.long()],
        position_ids=pos.long(),
        parents=parents,
        node_depths=depths,
        cu_num_nodes=cu_out,
        generation_lengths=lengths,
        position_offsets=offsets,
        packed_mask=mask,
    )

