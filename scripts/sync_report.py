"""Host synchronisations of real ECHO steps on a CUDA device, counted two ways (scripts/gpu_check.sh runs this):

- the runtime's own ledger (`StepReport.traffic.syncs`: the reads that go through `runtime.transfer.HostLink`);
- torch's CUDA sync debug mode, which warns at every operation that makes the host wait for the device,
  wherever it is (a Python int() of a device tensor, .cpu(), nonzero, ...).

The difference is the uncounted syncs (the wall clock's timing syncs are torch.cuda.synchronize calls, which the
debug mode does not flag). Prints one line per step and the first places the debug mode flagged; writes JSON.

    python scripts/sync_report.py [OUTPUT_JSON]
"""

from __future__ import annotations

import collections
import json
import sys
import traceback
import warnings

import torch

from echo_trtllm.core import EchoConfig
from echo_trtllm.models import DEFAULT_EAGLE3, DEFAULT_TARGET
from echo_trtllm.models.eagle3 import load_eagle3
from echo_trtllm.models.loader import load_model
from echo_trtllm.runtime.executor import Executor
from echo_trtllm.runtime.request import SamplingParams
from echo_trtllm.bench.prompts import load_prompts


def main() -> int:
    if not torch.cuda.is_available():
        print("sync_report: needs a CUDA device", file=sys.stderr)
        return 1
    target, tok = load_model(DEFAULT_TARGET, device="cuda")
    head = load_eagle3(DEFAULT_EAGLE3, target)
    ex = Executor(target, head, tok, EchoConfig(policy="echo", k_max=256), max_batch_size=8, max_seq_len=256)
    for p in load_prompts("mixed"):
        ex.submit(ex.make_request(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)))
    ex.step()  # admission and prefill happen here; the report covers decode steps
    places: collections.Counter[str] = collections.Counter()
    rows = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        while ex.has_work:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                report = ex.step()
            flagged = [w for w in caught if "synchroniz" in str(w.message).lower()]
            for w in flagged:
                places[f"{w.filename}:{w.lineno}"] += 1
            rows.append({"speculated": report.speculated, "ledger_syncs": report.traffic.syncs,
                         "debug_mode_syncs": len(flagged), "levels": len(report.draft.state.frontier_sizes)
                         if report.draft is not None else 0})
            print(f"step {len(rows):3d} speculated={report.speculated!s:5} ledger={rows[-1]['ledger_syncs']} "
                  f"debug-mode={rows[-1]['debug_mode_syncs']}")
    except Exception:  # noqa: BLE001 - a report, not a test: say what happened
        traceback.print_exc()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print("places the debug mode flagged (count):")
    for place, n in places.most_common(20):
        print(f"  {n:5d}  {place}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"steps": rows, "places": dict(places)}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
