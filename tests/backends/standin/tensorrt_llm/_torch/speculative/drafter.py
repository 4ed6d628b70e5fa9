"""Stand-in for tensorrt_llm._torch.speculative.drafter (TensorRT-LLM 1.2): the Drafter base class's constructor
and abstract method as 1.2 declares them."""

from abc import ABC, abstractmethod
from typing import Dict, Optional


class Drafter(ABC):
    def __init__(self, max_draft_len: int = None, max_total_draft_tokens: int = None,
                 max_concurrency: Optional[int] = None, draft_len_schedule: Optional[Dict[int, int]] = None) -> None:
        self.max_draft_len = max_draft_len
        self.max_total_draft_tokens = max_total_draft_tokens
        self.max_concurrency = max_concurrency
        self.draft_len_schedule = draft_len_schedule

    @abstractmethod
    def prepare_draft_tokens(self, scheduled_requests, resource_manager=None) -> None:
        raise NotImplementedError
