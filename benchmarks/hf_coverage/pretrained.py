"""The matrix's *pretrained* columns (issue 39): a family started from a ``save_pretrained`` folder, trained
sharded, exported back.

For each family (:func:`save_folder`): ``save_pretrained`` of its tiny model, randomly initialised from another
seed than the suite's own initialisation (a rank that read nothing would keep other values). The folder is given
to the recipe as ``pretrained=`` (what ``lp-train model.pretrained=DIR`` does: the model is built on ``meta``,
split by the layout, and each rank reads only its slices, per-expert keys stacked into the experts it owns),
trained the matrix's steps under tensor 2 or data 2 x expert 2
(:func:`fit_from_folder`), and its sharded checkpoint is exported with ``lp-convert --to hf``
(:func:`export_difference`). The reference is one process whose model is ``from_pretrained`` of the same folder.

A cell is PARITY (:func:`verdict`) when the training is (:func:`~.table.verdict`: every rank's loss and every
final parameter within the tolerance, with the same fp32-floor rule), every parameter gathered before the first
step equals the reference's -- ``from_pretrained``'s -- exactly, and ``from_pretrained`` of the export holds the
reference's trained parameters within the tolerance. REFUSED: the plain layout's refusal, or the folder refused by
:func:`~lightning_parallel.checkpoints.hf.load.match_folder` on ``meta`` (``lp-train``'s preflight).
"""

from __future__ import annotations

import io
import shutil
from contextlib import redirect_stderr, redirect_stdout
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch

from benchmarks.hf_coverage import cells, table
from examples.nlp.hf_causal_lm import HFCausalLM

REFERENCE = "pretrained_single"
COLUMNS = ("pretrained_tp2", "pretrained_dp2_ep2")
# The folder's weights are drawn with another seed than the suite's own initialisation (seed 0 in every cell), so
# that a rank which failed to read its slices -- keeping the values it was initialised with -- is caught.
FOLDER_SEED = 1


def _transformers() -> Any:
    """transformers, its progress bars off (one per save and load here, and in every launch)."""
    import transformers

    transformers.logging.disable_progress_bar()
    return transformers


def folder_of(root: Path, model_type: str) -> Path:
    """The family's ``save_pretrained`` folder under the results folder ``root``."""
    return Path(root) / "pretrained" / model_type


def _checkpoint(root: Path, layout: str, model_type: str) -> Path:
    return Path(root) / "pretrained" / f"{model_type}.{layout}.ckpt"


def save_folder(model_type: str, root: Path) -> Optional[str]:
    """Write the family's folder once (kept on resume): the tiny model, initialised as the recipe initialises it but
    from :data:`FOLDER_SEED`.

    Returns:
        Why ``save_pretrained`` failed, or None.
    """
    folder = folder_of(root, model_type)
    if (folder / "config.json").is_file():
        return None
    partial_folder = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(partial_folder, ignore_errors=True)
    torch.manual_seed(FOLDER_SEED)
    try:
        _transformers()  # its progress bars off
        cells.TinyFamily(model_type).build().model.save_pretrained(partial_folder)
    except Exception as error:  # noqa: BLE001 -- transformers' failure, shown in the cell
        return cells.short_error(error)
    partial_folder.rename(folder)
    return None


def folder_module(folder: str, from_pretrained: bool) -> HFCausalLM:
    """The recipe's module given ``folder`` as ``pretrained`` (the suite loads it after the split), or -- for the
    one-process reference -- holding ``from_pretrained(folder)`` already (the recipe's loader then stays out)."""
    module = HFCausalLM(pretrained=folder, vocab_size=None, attn_implementation="eager", weight_decay=0.0,
                        optimizer=partial(torch.optim.SGD, lr=cells.LR))
    if from_pretrained:
        module.model = _transformers().AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
        module.pretrained_loaded = True
    return module


class LoadedParameters(pl.Callback):
    """Every parameter gathered whole before the first step (after the folder was loaded), on rank 0."""

    def __init__(self) -> None:
        self.parameters: Optional[dict[str, torch.Tensor]] = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_parallel.testing.compare import full_parameters

        parameters = full_parameters(pl_module)  # a collective: every rank gathers
        self.parameters = parameters if trainer.global_rank == 0 else None


def fit_from_folder(model_type: str, layout: str, world_size: int, root: Path) -> dict[str, Any]:
    """Rank function of a pretrained layout (through :func:`~.cells.run_cells`): the cell's usual result, plus
    ``loaded_parameters``; a column (not the reference) saves its trained sharded checkpoint for the export."""
    loaded = LoadedParameters()
    make = partial(folder_module, str(folder_of(root, model_type)), layout == REFERENCE)
    checkpoint = None if layout == REFERENCE else _checkpoint(root, layout, model_type)
    result = cells.fit_module(make, layout, world_size, (loaded,), checkpoint)
    return {**result, "loaded_parameters": loaded.parameters}


def refusal(model_type: str, layout: str, root: Path) -> Optional[str]:
    """The plain layout's refusal before start, else the folder's (``lp-train``'s preflight check on ``meta``)."""
    from lightning_parallel.checkpoints.hf.load import match_folder

    refused = cells.refusal(model_type, cells.SAME_STRATEGY[layout])
    if refused:
        return refused
    folder = folder_of(root, model_type)
    try:
        module = folder_module(str(folder), from_pretrained=False)
        with torch.device("meta"):
            module.configure_model()
    except Exception:  # noqa: BLE001 -- the recipe cannot build it: the runs (reference included) show why
        return None
    try:
        match_folder(module, folder, "model.")
    except ValueError as error:
        return f"model.pretrained={folder.name}: {str(error).replace(str(folder), folder.name)}"  # no local path
    return None


def _read_back(folder: Path) -> dict[str, torch.Tensor]:
    """``from_pretrained(folder)``'s parameters under the LightningModule's names (as :func:`full_parameters`)."""
    model = _transformers().AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    return {f"model.{name}": p.detach().to(torch.float64) for name, p in model.named_parameters(remove_duplicate=False)}


def read_back_reference(root: Path, model_type: str, trained: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What transformers gives back for the one-process trained model: ``from_pretrained`` of its ``save_pretrained``.

    Note:
        Not ``trained`` itself: ``from_pretrained`` does not always return what was saved. Youtu's
        ``_init_weights`` zeroes the embedding's padding row on load (it writes through ``.data``, past transformers'
        loaded-weights guard), a row that training moved through the tied head (4.7e-4 after the matrix's steps):
        the suite's export is judged against transformers' own round trip, not against that.

    Raises:
        ValueError: ``trained`` holds names the family's model does not have.
    """
    out = Path(root) / "pretrained" / f"{model_type}.{REFERENCE}.hf"
    if not (out / "config.json").is_file():
        model = _transformers().AutoModelForCausalLM.from_pretrained(folder_of(root, model_type))
        state = {name[len("model."):]: value.to(torch.float32) for name, value in trained.items()}
        unexpected = model.load_state_dict(state, strict=False).unexpected_keys
        if unexpected:
            raise ValueError(f"the one-process trained model holds {unexpected[:3]}, which "
                             f"{type(model).__name__} does not: the reference run built another model.")
        model.save_pretrained(out)
    return _read_back(out)


def export_difference(root: Path, layout: str, model_type: str, expected: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``lp-convert CKPT OUT --to hf`` of the cell's trained checkpoint, then ``from_pretrained(OUT)``'s parameters
    against ``expected`` (:func:`read_back_reference`): ``{"difference", "where"}``, or ``{"error"}``."""
    from lightning_parallel.cli.convert import main as lp_convert

    out = Path(root) / "pretrained" / f"{model_type}.{layout}.hf"
    said = io.StringIO()
    try:
        with redirect_stdout(said), redirect_stderr(said):
            code = lp_convert([str(_checkpoint(root, layout, model_type)), str(out), "--to", "hf"])
        if code != 0:
            return {"error": f"lp-convert --to hf: {' '.join(said.getvalue().split())[-300:]}"}
        exported = _read_back(out)
    except (Exception, SystemExit) as error:  # noqa: BLE001 -- argparse exits; either is the cell's defect
        return {"error": f"export: {cells.short_error(error)} {' '.join(said.getvalue().split())[-200:]}".strip()}
    difference, where = table.parameter_difference(exported, expected)
    return {"difference": difference, "where": where}


def verdict(refused: Optional[str], run: Optional[dict[str, Any]], reference: Optional[dict[str, Any]],
            floor: Optional[float] = None) -> table.Verdict:
    """A pretrained cell's verdict: the training's (:func:`~.table.verdict`), then the loaded parameters (exactly
    ``from_pretrained``'s) and the export (within the tolerance of the one-process trained model).

    Args:
        refused, floor: as :func:`~.table.verdict`.
        run: the column's result, with ``loaded_parameters`` and ``export`` (:func:`export_difference`).
        reference: the one-process run started from ``from_pretrained``.
    """
    if run is not None and "unsaved" in run:  # transformers' own save failed: no folder to start from
        return table.Verdict("DEFECT", cause=f"save_pretrained of the tiny model failed: {run['unsaved']}")
    cell = table.verdict(refused, run, reference, floor)
    if cell.kind != "PARITY":
        return cell
    ours, theirs = run.get("loaded_parameters"), reference.get("loaded_parameters")
    loaded, where = table.parameter_difference(ours or {}, theirs or {}) if ours and theirs else (float("inf"), "")
    if loaded != 0.0:
        return table.Verdict("DEFECT", loaded, "the loaded parameters are not from_pretrained's: "
                             f"{loaded:.3g} off ({where or 'none recorded'})")
    export = run.get("export") or {"error": "no export"}
    if "error" in export:
        return table.Verdict("DEFECT", cause=f"the export failed: {export['error']}")
    off = export["difference"]
    # At the fp32 floor the trained model itself is that far from one process: its export may be no farther.
    if not off <= (max(table.TOLERANCE, cell.figure) if cell.cause else table.TOLERANCE):
        return table.Verdict("DEFECT", off, f"from_pretrained of the export is {off:.3g} off the one-process trained "
                             f"model ({export['where']})")
    return table.Verdict("PARITY", max(cell.figure, off), cell.cause)


def run_columns(wanted: dict[str, list[str]], root: Path, cell_timeout: float,
                say: Callable[[str], None]) -> tuple[dict, dict]:
    """``(refusals before start, runs)`` of the pretrained columns: the folders, the reference, each column and its
    exports.

    Args:
        wanted: ``{column: the model types with its plan}``.
        root: the results folder (the folders, checkpoints and exports go under ``root/pretrained``).
        cell_timeout: seconds for one family in one launch.
        say: where progress lines go.
    """
    families = list(dict.fromkeys(m for models in wanted.values() for m in models))
    unsaved = {m: error for m in families if (error := save_folder(m, root))}
    refused = {(m, layout): refusal(m, layout, root) for layout, models in wanted.items() for m in models
               if m not in unsaved}
    reference = cells.run_layout(REFERENCE, [m for m in families if m not in unsaved], root, cell_timeout)
    runs, read_back = {REFERENCE: reference}, {}
    say(f"{REFERENCE}: {len(reference)} folders written by save_pretrained, loaded with from_pretrained"
        + (f" ({len(unsaved)} could not be saved)" if unsaved else ""))
    for layout, models in wanted.items():
        chosen = [m for m in models if m not in unsaved and not refused[m, layout]]
        runs[layout] = cells.run_layout(layout, chosen, root, cell_timeout)
        for m in chosen:
            run, ref = runs[layout][m], reference.get(m) or {}
            if run and "defect" not in run and ref.get("parameters"):
                run["export"] = _export(root, layout, m, ref["parameters"], read_back)
        runs[layout].update({m: {"unsaved": unsaved[m]} for m in models if m in unsaved})
        say(f"{layout}: {len(chosen)} run and exported, {len(models) - len(chosen)} refused or unsaved")
    return refused, runs


def _export(root: Path, layout: str, model_type: str, trained: dict[str, torch.Tensor],
            read_back: dict[str, Any]) -> dict[str, Any]:
    """The cell's export against the one-process model read back (once per family, kept in ``read_back``)."""
    if model_type not in read_back:
        try:
            read_back[model_type] = read_back_reference(root, model_type, trained)
        except Exception as error:  # noqa: BLE001 -- transformers' own round trip failed: the cell cannot be judged
            read_back[model_type] = ("save_pretrained / from_pretrained of the one-process model: "
                                     f"{cells.short_error(error)}")
    if isinstance(read_back[model_type], str):
        return {"error": read_back[model_type]}
    return export_difference(root, layout, model_type, read_back[model_type])
