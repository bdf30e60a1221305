"""The fault matrix's fault-tolerant rows: replica groups (torchft) with a group killed or hung, the lighthouse lost.

``python -m benchmarks.fault_replicas [--layouts one,"pipeline 2"] [--steps 24] [--out DIR]`` runs every trial of
:data:`FAULTS` under each layout (2 replica groups, each of the layout's ranks: the residual MLP of width 16, AdamW,
a fixed data order; ``lightning_parallel.testing.run_replica_groups`` as the supervisor: a lighthouse in this
process, a failed group stopped and started again once, 3 s later) and writes ``fault_replicas.json`` and
``fault_replicas.md`` (the table of docs/fault-matrix.md). A trial's outcome is

* ``trained on`` -- every group finished every step, and the committed steps equal one process taking the same
  steps on the same batches (parameters and every committed loss within :data:`TOLERANCE`; the test suite's
  rule, tests/distributed/fault_tolerance/test_replica_recovery.py);
* ``stopped, clear error`` -- the supervisor stopped the run with an error that names the lighthouse or the quorum;

and the failures: ``HANG`` (the run outlived its deadline), ``SILENT`` (trained on to other numbers), ``UNCLEAR``
(stopped without naming the cause). Time to detect: from the fault (the lighthouse shut down, or the fault's step
reached) to the supervisor's first group failure or, for a group lost, the first step the others committed without it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_parallel.testing.faults import fail_at, hang_at
from lightning_parallel.testing.processes import DistributedRunError
from lightning_parallel.testing.replica_groups import run_replica_groups
from tests.distributed.fault_tolerance.replica_runs import recorded, reference_run, replica_rank

FAULT_STEP = 5
TOLERANCE = 1e-5
# The supervisor's settings: a quorum waits 30 s, a hung group stops itself after 5 s, collectives time out at 10 s.
FT = {"timeout": 10, "quorum_timeout": 30, "group_timeout": 5, "connect_timeout": 5}
CLEAR = ("lighthouse", "quorum", "replica group")


@dataclass(frozen=True)
class Fault:
    """One fault of the replica rows: the groups' faults and, when ``lighthouse_at``, the lighthouse shut down once
    group 0 has committed that many steps."""

    faults: tuple = ()
    lighthouse_at: Optional[int] = None


FAULTS: dict[str, Fault] = {
    "group killed": Fault((fail_at(replica=1, rank=0, step=FAULT_STEP),)),
    "group hung": Fault((hang_at(replica=1, rank=0, step=FAULT_STEP),)),
    "lighthouse lost": Fault(lighthouse_at=FAULT_STEP),
    "lighthouse lost then a group killed": Fault((fail_at(replica=1, rank=0, step=3 * FAULT_STEP),), FAULT_STEP),
}
LAYOUTS = {"one": 1, "pipeline 2": 2, "tensor 2": 2}  # the replica_runs layouts: ranks per group


class LighthouseKiller:
    """The supervisor's tick: shuts the lighthouse down once group 0 has committed ``at`` steps (read from its
    committed-step records), and keeps the time."""

    def __init__(self, folder: Path, at: Optional[int]) -> None:
        self.folder, self.at, self.fired, self.committed = folder, at, None, None

    def __call__(self, lighthouse: Any) -> None:
        if self.at is None or self.fired is not None:
            return
        path = self.folder / "group0_run0.pt"
        try:
            committed = len(torch.load(path, weights_only=False)) if path.is_file() else 0
        except (EOFError, RuntimeError):  # being written
            return
        if committed >= self.at:
            lighthouse.shutdown()
            self.fired, self.committed = time.time(), committed


def _parity(result: Any, folder: Path, groups: int) -> tuple[float, float]:
    """Parameters and committed losses of group 0 against one process on the same committed steps and batches."""
    records = recorded(folder, groups)
    reference, losses = reference_run(records, replicas=groups)
    full: dict[str, torch.Tensor] = {}
    for out in result.outputs[0]:
        full.update(out["full"])
    params = max(float((full[k] - reference[k]).abs().max()) for k in reference)
    return params, max(abs(r["loss"] - loss) for r, loss in zip(records[0], losses))


def run_trial(layout: str, name: str, steps: int, root: Path) -> dict[str, Any]:
    """One trial in its own folder; its table row."""
    fault, folder = FAULTS[name], root / f"{layout}-{name}".replace(" ", "_").replace(",", "")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    killer = LighthouseKiller(folder, fault.lighthouse_at)
    started = time.time()
    row: dict[str, Any] = {"layout": layout, "fault": name, "restarts": None, "detect_s": None, "max_diff": None,
                           "error": ""}
    try:
        result = run_replica_groups(replica_rank, 2, LAYOUTS[layout], layout, steps, fault.faults, FT, str(folder),
                                    timeout=300, restart_delay=3.0, watch=killer)
    except DistributedRunError as error:
        text = " ".join(str(error).split())
        row["error"] = _telling(str(error))
        row["detect_s"] = round(time.time() - killer.fired, 1) if killer.fired else None
        hung = "timed out" in text and "replica groups timed out" in text
        row["outcome"] = "HANG" if hung else ("stopped, clear error" if any(w in text for w in CLEAR) else "UNCLEAR")
        return {**row, "wall_s": round(time.time() - started, 1)}
    params, losses = _parity(result, folder, 2)
    survivor = recorded(folder, 2)[0]
    alone = [r["step"] for r in survivor if r["participants"] == 1]
    row.update(restarts=result.restarts, max_diff=max(params, losses), alone_steps=len(alone),
               lighthouse_lost_at=killer.committed,  # group 0's committed steps when it was shut down
               outcome="trained on" if max(params, losses) <= TOLERANCE else "SILENT")
    return {**row, "wall_s": round(time.time() - started, 1)}


def _telling(text: str) -> str:
    """The most telling line of a supervisor's error: the last one naming the lighthouse or the quorum."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = [line for line in lines if any(word in line for word in CLEAR)]
    return (named[-1] if named else lines[-1] if lines else "")[:300]


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table of docs/fault-matrix.md's replica-group rows."""
    lines = ["| layout (per group) | fault | outcome | restarts | steps alone | max diff | wall s | error |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        diff = "" if row["max_diff"] is None else f"{row['max_diff']:.1e}"
        lines.append(f"| {row['layout']} | {row['fault']} | {row['outcome']} | {row['restarts'] or ''} | "
                     f"{row.get('alone_steps', '')} | {diff} | {row['wall_s']} | "
                     f"{row['error'].replace('|', '/')[:160]} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m benchmarks.fault_replicas``: every fault under the layouts named."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of: {', '.join(LAYOUTS)}")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of: {', '.join(FAULTS)}")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fault_matrix"))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lp_fault_replicas"))
    args = parser.parse_args(argv)
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    for layout in args.layouts.split(","):
        for name in args.faults.split(","):
            rows.append(run_trial(layout, name, args.steps, args.workdir))
            print(json.dumps(rows[-1]), flush=True)
            (args.out / "fault_replicas.json").write_text(json.dumps(rows, indent=1))
            (args.out / "fault_replicas.md").write_text(markdown(rows))


if __name__ == "__main__":
    main()
