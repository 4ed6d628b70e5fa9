"""Host <-> device traffic of the runtime, counted where it happens.

The control plane (drafting loop, gate, budget, packing on CPU) runs on the host; the models run on their device.
Every tensor the runtime moves between the two goes through one `HostLink`, which counts it:

    link.read("draft top-k", probs, tokens)   device -> host: one host synchronisation for the group, its bytes
    link.send("packed tree", tensor)          host -> device: bytes (an asynchronous copy, no synchronisation)

On a GPU a read is the host waiting for the device (a sync); on CPU the model's device is the host, nothing is
copied and the counts say what a GPU run of the same step would move. Reads the runtime does not route through
the link (a Python int() of a device tensor inside a model or the core) are not counted here;
`scripts/gpu_check.sh` runs a step under torch's CUDA sync debug mode to find those.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["HostLink", "Traffic"]


@dataclass
class Traffic:
    """What one step (or any stretch between two `HostLink.take` calls) moved."""

    # device -> host reads (each one host synchronisation on a GPU)
    syncs: int = 0
    to_host_bytes: int = 0
    to_device_bytes: int = 0
    # the largest single read, bytes (a vocabulary-sized row would show here)
    largest_read_bytes: int = 0
    # bytes and count per label
    reads: dict[str, list[int]] = field(default_factory=dict)
    sends: dict[str, list[int]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"syncs": self.syncs, "to_host_bytes": self.to_host_bytes, "to_device_bytes": self.to_device_bytes,
                "largest_read_bytes": self.largest_read_bytes,
                "reads": {k: {"count": c, "bytes": b} for k, (c, b) in self.reads.items()},
                "sends": {k: {"count": c, "bytes": b} for k, (c, b) in self.sends.items()}}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class HostLink:
    """The one way tensors cross between the host and `device` (module docstring)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.traffic = Traffic()

    def read(self, what: str, *tensors: Tensor | None) -> tuple[Tensor | None, ...]:
        """The tensors on the host (None passes through); one synchronisation for the group."""
        n = _nbytes(tensors)
        t = self.traffic
        t.syncs += 1
        t.to_host_bytes += n
        t.largest_read_bytes = max(t.largest_read_bytes, n)
        count, total = t.reads.get(what, (0, 0))
        t.reads[what] = [count + 1, total + n]
        gpus = {x.device for x in tensors if x is not None and x.device.type == "cuda"}
        if not gpus:  # on the host already (no call where .cpu() would return the tensor itself)
            return tuple(x if x is None or x.device.type == "cpu" else x.cpu() for x in tensors)
        # every copy queued without waiting, then one wait for the stream: one synchronisation for the group
        out = tuple(None if x is None else x.to("cpu", non_blocking=True) for x in tensors)
        for dev in gpus:
            torch.cuda.current_stream(dev).synchronize()
        return out

    def send(self, what: str, tensor: Tensor) -> Tensor:
        """`tensor` on the device (non-blocking from pinned memory where the device copies asynchronously)."""
        n = _nbytes([tensor])
        t = self.traffic
        t.to_device_bytes += n
        count, total = t.sends.get(what, (0, 0))
        t.sends[what] = [count + 1, total + n]
        if tensor.device == self.device:
            return tensor  # what .to would return, without the call
        return tensor.to(self.device, non_blocking=True)

    def take(self) -> Traffic:
        """What moved since the last take; starts a new count."""
        out, self.traffic = self.traffic, Traffic()
        return out
