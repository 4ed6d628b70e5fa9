"""The ECHO algorithm: pure, device-agnostic PyTorch. Imports nothing above it (no runtime, model, TensorRT)."""

from .budget import BudgetAllocation, allocate_budget
from .config import POLICY_NAMES, EchoConfig
from .controller import Decision, SpeculationController
from .cost import CostModel, break_even_accept_prob, choose_budget
from .gating import GateCalibration, GateConfig, GateSamples, GateSchedule, best_path_confidence, calibrate_gate, gate
from .pack import PackedVerifyBatch, pack, pack_from_parents, unpack_mask
from .prices import StepCostModel, StepPrices
from .policies import POLICIES, DraftLoop, DraftResult, DraftState, TreePolicy, draft_tree, make_policy
from .steps import StepSample
from .tree import DraftLevel, DraftTopK, SuperTree, expand_level, root_level
from .verify import SamplingTensors, VerifyResult, process_logits, verify, verify_greedy, verify_sampling

__all__ = [
    "BudgetAllocation", "allocate_budget", "POLICY_NAMES", "EchoConfig", "CostModel", "Decision", "SpeculationController",
    "break_even_accept_prob", "choose_budget", "GateCalibration", "GateConfig", "GateSamples", "GateSchedule",
    "best_path_confidence", "calibrate_gate", "gate", "PackedVerifyBatch", "pack", "pack_from_parents",
    "unpack_mask", "POLICIES", "DraftLoop", "DraftResult", "DraftState", "TreePolicy", "draft_tree", "make_policy",
    "DraftLevel", "DraftTopK", "SuperTree", "expand_level", "root_level", "SamplingTensors", "VerifyResult",
    "process_logits", "verify", "verify_greedy", "verify_sampling", "StepCostModel", "StepPrices", "StepSample",
]  # fmt: skip
