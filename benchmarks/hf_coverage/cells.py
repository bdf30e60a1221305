"""One cell of the coverage matrix: a family trained a few steps under one layout, as a user would.

The module is the HF recipe's :class:`~examples.nlp.hf_causal_lm.HFCausalLM` at the family's tiny config
(:func:`~.tiny.tiny_config`): no protocol method, built in ``configure_model`` (on ``meta`` under the suite's
strategies, so each rank materialises its own share), eager attention, plain SGD (see :data:`LR`) or AdamW
(the modes of :mod:`.optimizers`). The data are right-padded documents with masked prompts (valid-token counts
differ between rows, micro-batches and ranks), served in a fixed order (Lightning's distributed sampler off).
Each layout runs the families one after another in one launch (:func:`run_layout`); the single process is the
reference layout.

Before any process starts, :func:`refusal` runs the suite's own checks for the layout on the family built
in this process (the pipeline's chain check included): a ``ValueError`` there is the cell's refusal. In the
ranks, a cell that raises, or runs longer than ``cell_timeout`` seconds (a watchdog ends the launch), is a
defect; the launch is then started again with the families left.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch

from benchmarks.hf_coverage.arithmetic import MICROBATCHES
from benchmarks.hf_coverage.optimizers import OPTIMIZERS, optimizer
from benchmarks.hf_coverage.tiny import VOCAB, tiny_config
from examples.nlp.hf_causal_lm import HFCausalLM

GLOBAL_BATCH, SEQ = 8, 16
STEPS, LR = OPTIMIZERS["sgd"].steps, OPTIMIZERS["sgd"].lr
# SGD by default: AdamW divides each gradient element by its own running size, so fp32 reordering noise on an
# element near zero becomes an update of lr size (measured: 1.3e-3 in an embedding row of Qwen3 under tensor 2 at
# lr 0.1 with equal losses, 3e-5 at eps=1e-6). Under SGD a parameter moves by lr x its gradient: noise stays at its
# own scale and a parameter off by more than the tolerance is wrong. AdamW cells are judged against the family's
# floor under the same arithmetic (:mod:`.optimizers`, :mod:`.floor`).
CELL_TIMEOUT = 180.0  # seconds for one family in one launch (build, fit, gather)
WATCHDOG_EXIT = 124


def _strategy(name: str) -> Any:
    from lightning_parallel.strategies import HybridParallelStrategy as Hybrid

    return {
        "tp2": lambda: Hybrid(tensor_parallel_size=2, timeout=60),
        "pp2": lambda: Hybrid(pipeline_parallel_size=2, microbatches=MICROBATCHES, timeout=60),
        "pp2xtp2": lambda: Hybrid(pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=MICROBATCHES,
                                  timeout=60),
        "dp2_zero2": lambda: Hybrid(data_parallel_size=2, zero_stage=2, timeout=60),
        "dp2_ep2": lambda: Hybrid(data_parallel_size=2, expert_parallel_size=2, timeout=60),
        "tp2_loss_parallel": lambda: Hybrid(tensor_parallel_size=2, loss_parallel=True, timeout=60),
    }[name]()


#: layout name -> (processes, which plan the family needs: "tp", "pp", "both", "ep" or None)
LAYOUTS: dict[str, tuple[int, Optional[str]]] = {
    "single": (1, None), "tp2": (2, "tp"), "pp2": (2, "pp"), "pp2xtp2": (4, "both"), "dp2_zero2": (2, None),
    "dp2_ep2": (2, "ep"),
    "tp2_loss_parallel": (2, "tp"),  # not a matrix column: the loss-parallel check of tests/distributed
    # Started from a save_pretrained folder (:mod:`.pretrained`): its one-process reference and its two columns.
    "pretrained_single": (1, None), "pretrained_tp2": (2, "tp"), "pretrained_dp2_ep2": (2, "ep"),
}
#: layouts that train under another layout's strategy (a folder-started column under its plain layout's)
SAME_STRATEGY = {"pretrained_single": "single", "pretrained_tp2": "tp2", "pretrained_dp2_ep2": "dp2_ep2"}


def strategy_for(layout: str) -> Any:
    """The strategy object of a layout (``"auto"`` for the single process)."""
    layout = SAME_STRATEGY.get(layout, layout)
    return "auto" if layout == "single" else _strategy(layout)


class TinyFamily(HFCausalLM):
    """The recipe's module at one family's tiny config (random weights, seeded as every layout seeds them).

    Args:
        model_type: the family.
        mode: the optimizer mode (:data:`~.optimizers.OPTIMIZERS`), with the recipe's decay groups.
    """

    def __init__(self, model_type: str, mode: str = "sgd") -> None:
        chosen = optimizer(mode)
        super().__init__(config="llama", vocab_size=None, attn_implementation="eager",
                         weight_decay=chosen.weight_decay, optimizer=chosen.factory())
        self.model_type = model_type
        self.model_config = tiny_config(model_type)


def padded_batches(steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    """``steps`` global batches of right-padded documents with masked prompts, one sample per entry."""
    generator = torch.Generator().manual_seed(1)
    samples = []
    for _ in range(steps * GLOBAL_BATCH):
        ids = torch.randint(3, VOCAB, (SEQ,), generator=generator)
        length = int(torch.randint(4, SEQ + 1, (1,), generator=generator))
        prompt = int(torch.randint(0, 3, (1,), generator=generator))
        mask = (torch.arange(SEQ) < length).long()
        ids = ids.masked_fill(mask == 0, 0)
        labels = ids.masked_fill((mask == 0) | (torch.arange(SEQ) < prompt), -100)
        samples.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return samples


def _data(strategy: Any, world_size: int, steps: int) -> Any:
    from lightning_parallel.strategies.resolve import resolve_layout
    from lightning_parallel.testing.models import FixedOrderData

    layout = resolve_layout(strategy, world_size)
    return FixedOrderData(padded_batches(steps), GLOBAL_BATCH // layout.data_parallel)


def refusal(model_type: str, layout: str) -> Optional[str]:
    """The suite's refusal of the cell before any process starts (its message), or None when it would run."""
    if layout == "single":
        return None
    from lightning_parallel.cli.preflight import layout_of
    from lightning_parallel.parallel.compose import check_module

    strategy = strategy_for(layout)
    torch.manual_seed(0)
    try:
        module = TinyFamily(model_type).build()
    except Exception:  # noqa: BLE001 -- the recipe cannot build it: the runs (reference included) show why
        return None
    try:
        check_module(module, layout_of(strategy, LAYOUTS[layout][0]), strategy.options)
    except ValueError as error:
        return str(error)
    return None


def _fit(model_type: str, layout: str, world_size: int, root: Path, mode: str) -> dict[str, Any]:
    if layout in SAME_STRATEGY:  # started from the family's save_pretrained folder (SGD only)
        from benchmarks.hf_coverage.pretrained import fit_from_folder

        return fit_from_folder(model_type, layout, world_size, root)
    every_step = mode != "sgd"  # AdamW's cells name the first step and parameter that departs (:mod:`.departure`)
    return fit_module(partial(TinyFamily, model_type, mode), layout, world_size, steps=optimizer(mode).steps,
                      every_step=every_step)


def fit_module(make: Callable[[], pl.LightningModule], layout: str, world_size: int, callbacks: tuple = (),
               checkpoint: Optional[Path] = None, steps: int = STEPS, every_step: bool = False) -> dict[str, Any]:
    """Train the module ``make()`` builds ``steps`` steps under ``layout`` on the matrix's batches.

    Args:
        make: builds the module (after the seed is set, as in every layout).
        layout: a key of :data:`LAYOUTS`.
        world_size: the launch's processes.
        callbacks: further callbacks (e.g. :class:`~.pretrained.LoadedParameters`).
        checkpoint: where to save the trained (sharded) checkpoint, if anywhere.
        steps: optimizer steps.
        every_step: record the whole model's parameters after every step, not only the first.

    Returns:
        ``{"losses", "parameters", "first_step_parameters", "step_parameters"}`` (parameters on rank 0 only;
        ``step_parameters`` holds the first step's alone unless ``every_step``).
    """
    from lightning_parallel.testing.compare import StepRecorder, full_parameters
    from lightning_parallel.testing.fit import quiet_trainer

    pl.seed_everything(0, verbose=False)
    module, strategy = make(), strategy_for(layout)
    recorder, taken = StepRecorder(), StepParameters(range(1, steps + 1) if every_step else (1,))
    trainer = quiet_trainer(world_size, strategy, steps, [recorder, taken, *callbacks], limit_val_batches=0,
                            num_sanity_val_steps=0)
    trainer.fit(module, datamodule=_data(strategy, world_size, steps))
    if checkpoint is not None:
        trainer.save_checkpoint(checkpoint)  # every rank writes its shards
    params = full_parameters(trainer.lightning_module)
    rank0 = trainer.global_rank == 0
    return {"losses": recorder.losses, "parameters": params if rank0 else None,
            "first_step_parameters": taken.parameters.get(1), "step_parameters": taken.in_order() if rank0 else None}


class StepParameters(pl.Callback):
    """The whole model's parameters after chosen optimizer steps, on rank 0 (``None`` elsewhere): a cell whose
    final parameters are off is judged by the first step's too (:func:`~.table.verdict`), and an AdamW cell by
    the first step where it departs (:mod:`.departure`).

    Args:
        steps: the optimizer steps (from 1) after which to gather.
    """

    def __init__(self, steps: Any) -> None:
        self.steps = set(steps)
        self.parameters: dict[int, Optional[dict[str, torch.Tensor]]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        from lightning_parallel.testing.compare import full_parameters

        step = trainer.global_step
        if step in self.steps and step not in self.parameters:
            parameters = full_parameters(pl_module)  # a collective: every rank gathers
            self.parameters[step] = parameters if trainer.global_rank == 0 else None

    def in_order(self) -> list[Optional[dict[str, torch.Tensor]]]:
        """The recorded parameters by step."""
        return [self.parameters[step] for step in sorted(self.parameters)]


def _watchdog(state: dict[str, Any], timeout: float, log: Path) -> None:
    while True:
        time.sleep(1.0)
        started = state.get("started")
        if started is not None and time.monotonic() - started > timeout:
            with log.open("a") as handle:
                handle.write(json.dumps({"family": state["family"], "status": "timeout",
                                         "error": f"no result after {timeout:.0f} s (hang)"}) + "\n")
            os._exit(WATCHDOG_EXIT)


def _save(folder: Path, layout: str, model_type: str, rank: int, result: dict[str, Any]) -> None:
    path = folder / layout / f"{model_type}.rank{rank}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(result, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def run_cells(rank: int, world_size: int, layout: str, model_types: list[str], folder: str,
              cell_timeout: float, mode: str = "sgd") -> None:
    """Rank function: each family under ``layout`` in turn, trained with the optimizer ``mode``; each result saved
    as it finishes, each event logged."""
    import logging
    import warnings

    for name in ("lightning.pytorch", "lightning.fabric", "lightning_parallel", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the strategies' start-up tables, once per cell: not wanted here
    root = Path(folder)
    log = root / f"{layout}.rank{rank}.jsonl"
    state: dict[str, Any] = {}
    threading.Thread(target=_watchdog, args=(state, cell_timeout, log), daemon=True).start()
    for model_type in model_types:
        state.update(family=model_type, started=time.monotonic())
        with log.open("a") as handle:
            handle.write(json.dumps({"family": model_type, "status": "started"}) + "\n")
        try:
            result = _fit(model_type, layout, world_size, root, mode)
        except Exception as error:
            with log.open("a") as handle:
                handle.write(json.dumps({"family": model_type, "status": "error", "error": short_error(error)}) + "\n")
            raise
        result["seconds"] = time.monotonic() - state["started"]
        state["started"] = None
        _save(root, layout, model_type, rank, result)
        with log.open("a") as handle:
            handle.write(json.dumps({"family": model_type, "status": "done"}) + "\n")


def short_error(error: BaseException) -> str:
    """An exception as one line of at most 400 characters (its type and message)."""
    lines = traceback.format_exception_only(type(error), error)
    return " ".join(" ".join(lines).split())[:400]


def _failure(folder: Path, layout: str, world_size: int, model_types: list[str], message: str) -> tuple[str, str]:
    """``(family, cause)`` of the cell a launch died in, from the ranks' logs."""
    events = []
    for rank in range(world_size):
        path = folder / f"{layout}.rank{rank}.jsonl"
        events += [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    done = {e["family"] for e in events if e["status"] == "done"}
    started = [e["family"] for e in events if e["status"] == "started" and e["family"] not in done]
    family = started[-1] if started else model_types[0]
    causes = [e["error"] for e in events if e["family"] == family and e["status"] in ("error", "timeout")]
    return family, causes[0] if causes else " ".join(message.split())[-400:]


def _load(folder: Path, layout: str, model_type: str, world_size: int) -> Optional[dict[str, Any]]:
    paths = [folder / layout / f"{model_type}.rank{rank}.pt" for rank in range(world_size)]
    if not all(path.is_file() for path in paths):
        return None
    ranks = [torch.load(path, weights_only=True) for path in paths]
    return {**ranks[0], "losses": [r["losses"] for r in ranks]}  # rank 0's parameters, every rank's losses


def run_layout(layout: str, model_types: list[str], folder: Path, cell_timeout: float = CELL_TIMEOUT,
               mode: str = "sgd") -> dict[str, dict[str, Any]]:
    """Every family of ``model_types`` under ``layout``, trained with the optimizer ``mode``: ``{family:
    {"losses", "parameters", "first_step_parameters", "step_parameters", "seconds"}}``, or
    ``{"defect": cause}`` for a cell that raised or hung after the processes started.

    One launch runs the families in turn, saving each result as it finishes; a cell that fails or hangs ends
    its launch, is recorded with its cause, and a new launch takes the families not yet run.
    """
    from lightning_parallel.testing import run_processes
    from lightning_parallel.testing.processes import DistributedRunError

    world_size, results = LAYOUTS[layout][0], {}
    folder.mkdir(parents=True, exist_ok=True)
    left = [m for m in model_types if _load(folder, layout, m, world_size) is None]
    while left:
        for rank in range(world_size):
            (folder / f"{layout}.rank{rank}.jsonl").unlink(missing_ok=True)
        try:
            run_processes(run_cells, world_size, layout, left, str(folder), cell_timeout, mode,
                          timeout=cell_timeout * len(left) + 120)
        except DistributedRunError as error:
            family, cause = _failure(folder, layout, world_size, left, str(error))
            results[family] = {"defect": cause}
        left = [m for m in left if m not in results and _load(folder, layout, m, world_size) is None]
    for model_type in model_types:
        results.setdefault(model_type, _load(folder, layout, model_type, world_size))
    return results
