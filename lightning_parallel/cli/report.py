"""The tables rank 0 prints: what a run is about to do, and what it did."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from lightning_parallel.cli.sweep_summary import METRICS_FILE
from lightning_parallel.layout import ParallelLayout
from lightning_parallel.parallel.activation_checkpoint import describe_choice
from lightning_parallel.scaling import EffectiveHparams


def startup_rows(
    strategy_name: str,
    layout: ParallelLayout,
    hparams: EffectiveHparams,
    reference: Optional[Mapping[str, Any]],
    accelerator: str,
    num_nodes: int,
    paths: Mapping[str, str],
    extra: Optional[Mapping[str, str]] = None,
) -> list[tuple[str, str]]:
    """Rows of the start-up table.

    Args:
        strategy_name: class or registry name of the strategy.
        layout: the resolved data x pipeline x tensor layout.
        hparams: effective batch / accumulation / lr / warm-up after rescaling.
        reference: the scaling reference (None when the rule is ``none``).
        accelerator: ``cpu`` or ``cuda``.
        num_nodes: nodes in the run.
        paths: ``output``, ``logs`` and ``checkpoints`` folders.
        extra: strategy-specific rows (pipeline split, rank map, ...).
    """
    per_node = layout.world_size // max(num_nodes, 1)
    rows = [
        ("strategy", strategy_name),
        ("world size", f"{layout.world_size} ({num_nodes} node(s) x {per_node} {accelerator} process(es))"),
        ("layout", f"{layout.describe()}  ({'data x context' if layout.context_parallel_enabled else 'data'} x "
                   "pipeline x tensor; only data multiplies the batch)"),
    ]
    rows += scaling_rows(hparams, reference)
    rows += list((extra or {}).items())
    rows += [(f"{name} dir", str(path)) for name, path in paths.items()]
    return rows


def scaling_rows(hparams: EffectiveHparams, reference: Optional[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """Rows that put the effective batch, accumulation, lr and warm-up beside the reference.

    Args:
        hparams: effective values after rescaling.
        reference: ``scaling.reference`` (ignored by the ``none`` rule).
    """
    h = hparams
    rows = [("scaling rule", h.rule)]
    ref = dict(reference or {}) if h.rule != "none" else {}
    if ref:
        devices = f" on {ref['devices']} data-parallel device(s)" if ref.get("devices") else ""
        rows.append(("reference", f"global batch {ref.get('global_batch_size')}, lr {ref.get('lr')}, "
                                  f"warm-up {ref.get('warmup_steps')}{devices}"))
    batch = f"{h.global_batch_size} = {h.micro_batch_size} x {h.accumulate_grad_batches} x dp{h.data_parallel}"
    lr_reference = f"  (reference {ref['lr']}, x{h.lr / ref['lr']:.4g})" if ref.get("lr") else ""
    rows += [
        ("micro-batch / device", str(h.micro_batch_size)),
        ("gradient accumulation", str(h.accumulate_grad_batches)),
        ("global batch", batch + (f"  (reference {ref['global_batch_size']})" if ref else "")),
        ("learning rate", f"{h.lr:.4g}" + lr_reference),
        ("warm-up steps", str(h.warmup_steps) + (f"  (reference {ref.get('warmup_steps')})" if ref else "")),
    ]  # fmt: skip
    if h.width_rule == "mup":
        rows.append(("width rule", f"mup from base width {h.base_width}: the lr above for embeddings, norms, biases "
                                   "and the head; hidden matrices at lr x base/width, logits x base/width"))
    return rows




def log_final_hparams(logger: Any, summary: dict[str, Any], metrics: dict[str, float]) -> None:
    """Log the layout and effective hyperparameters with the final metrics (TensorBoard's HParams tab).

    Args:
        logger: the run's Lightning logger.
        summary: :func:`run_summary` of the run.
        metrics: the final metrics.
    """
    params = {k: summary[k] for k in ("strategy", "devices", "num_nodes", "world_size", "layout")}
    params.update({f"effective/{k}": v for k, v in summary["effective"].items()})
    params.update({f"reference/{k}": v for k, v in summary["reference"].items() if v is not None})
    wanted = ("val_loss", "train_loss", "throughput/samples_per_sec", "throughput/tokens_per_sec")
    final = {f"hp/{k.split('/')[-1]}": metrics[k] for k in wanted if k in metrics}
    if final:
        logger.log_hyperparams(params, metrics=final)  # lp-train calls this in on_fit_end: Lightning then closes it


def fit_metrics(trainer: Any, datamodule: Any) -> dict[str, float]:
    """Scalar metrics at the end of fit, plus callback summaries (throughput, evaluation) and the data baseline.

    Training throughput appears once, as ``throughput/*`` from :class:`~lightning_parallel.callbacks.ThroughputReport`.

    Args:
        trainer: the Trainer after ``fit``.
        datamodule: the run's data module (``unigram_baseline()`` is added when it has one).
    """
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
    for callback in trainer.callbacks:
        metrics.update(getattr(callback, "summary", {}) or {})
    baseline = getattr(datamodule, "unigram_baseline", None)
    if callable(baseline):
        metrics["unigram_baseline"] = baseline()
    return metrics


def write_metrics(output_dir: Path, summary: dict[str, Any], metrics: dict[str, float]) -> Path:
    """Write ``metrics.json``: the run summary and its final metrics (one job of a sweep).

    Args:
        output_dir: the job's output folder.
        summary: :func:`run_summary` of the run.
        metrics: the final metrics.
    """
    path = output_dir / METRICS_FILE
    path.write_text(json.dumps({**summary, "metrics": metrics}, indent=2, sort_keys=True, default=str))
    return path


def startup_table(cfg: Any, strategy: Any, layout: ParallelLayout, effective: EffectiveHparams,
                  logger: Any, summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows of the start-up table of ``lp-train`` (see :func:`startup_rows`).

    Args:
        cfg: the run's config (paths, trainer, scaling).
        strategy: the strategy object or name.
        layout: the resolved layout.
        effective: the effective hyperparameters.
        logger: the run's logger (its folder is shown), or False.
        summary: ``lightning_parallel.cli.effective.run_summary`` of the run.
    """
    import torch
    from omegaconf import OmegaConf

    paths = {"output": cfg.paths.output_dir, "logs": getattr(logger, "log_dir", "-"),
             "checkpoints": cfg.paths.checkpoint_dir}
    extra = dict(strategy.startup_rows(layout)) if hasattr(strategy, "startup_rows") else {}
    if hasattr(strategy, "activation_checkpointing"):  # DeepSpeed's strategy; the hybrid one has the row already
        extra.setdefault("activation checkpointing", describe_choice(strategy.activation_checkpointing))
    extra.update(model_rows(cfg, strategy, layout))
    extra["same run on other devices"] = summary["reproduce"]
    reference = OmegaConf.to_container(cfg.scaling.reference, resolve=True)
    accelerator = cfg.trainer.accelerator
    cuda = accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())
    return startup_rows(summary["strategy"], layout, effective, reference, "cuda" if cuda else "cpu",
                        cfg.trainer.num_nodes, paths, extra)


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _meta_model(cfg: Any) -> tuple[Any, bool]:
    """``cfg.model`` instantiated on ``meta`` with its ``configure_model()`` run, and whether that hook created the
    parameters (the module had none before): what the strategies will build, at no memory cost."""
    import torch
    from hydra.utils import instantiate

    with torch.device("meta"):
        module = instantiate(cfg.model)
        before = sum(1 for _ in module.parameters())
        getattr(module, "configure_model", lambda: None)()
    return module, before == 0 and any(True for _ in module.parameters())


def layout_candidate(strategy: Any, layout: ParallelLayout) -> tuple[Any, str]:
    """The planner's :class:`~lightning_parallel.planner.candidates.Candidate` of a run, and who builds the model:
    ``"hybrid"`` (the suite's strategies), ``"deepspeed"`` or ``"replicas"`` (Lightning's DDP, one device).

    Args:
        strategy: the strategy object (or a name).
        layout: the resolved layout.
    """
    from lightning_parallel.parallel.options import ParallelOptions
    from lightning_parallel.planner.candidates import Candidate
    from lightning_parallel.strategies.resolve import strategy_object

    obj = strategy_object(strategy) if isinstance(strategy, str) else strategy
    dp, pp, tp = layout.data_parallel, layout.pipeline_parallel, layout.tensor_parallel
    options = getattr(obj, "options", None)
    if isinstance(options, ParallelOptions):
        shards = layout.data_shard if layout.hsdp_enabled else dp  # FSDP2 shards within an HSDP group
        piped = pp > 1
        context = layout.context_parallel
        candidate = Candidate("hybrid", shards, pp, tp, options.zero_stage, options.schedule if piped else "-",
                              options.stages_per_rank if piped else 1, options.microbatches if piped else 1, 1, 1, 1,
                              cp=context, cp_method=options.context_parallel_method if context > 1 else "-",
                              ep=layout.expert_parallel)
        return candidate, "hybrid"
    zero = getattr(obj, "zero_stage", None)
    if isinstance(zero, int):
        return Candidate("deepspeed", dp, 1, 1, zero, "-", 1, 1, 1, 1, 1), "deepspeed"
    return Candidate("hybrid", dp, 1, 1, 0, "-", 1, 1, 1, 1, 1), "replicas"


def _build_description(kind: str, deferred: bool, zero: int) -> str:
    if not deferred:
        return "in __init__: every rank holds the whole model before the strategy splits it"
    if kind == "hybrid":
        return "configure_model on meta: only this rank's share is allocated"
    if kind == "deepspeed" and zero == 3:
        return "configure_model under deepspeed.zero.Init: each parameter is partitioned as it is created"
    return "configure_model with storage: every rank builds the whole model (seeded as every layout is)"


def model_rows(cfg: Any, strategy: Any, layout: ParallelLayout) -> dict[str, str]:
    """Start-up rows on the model: its size, how the run builds it, and the bytes a rank is expected to hold.

    The bytes are the planner's memory model (:mod:`lightning_parallel.planner.memory`) for this layout, on
    the most loaded rank: parameters, gradients and optimizer state at rest (activations not counted), and
    the peak while the model is built and split. A model that cannot be built here gets one row saying why.

    Args:
        cfg: the run's config (``model``, ``trainer.precision``).
        strategy: the strategy object or name.
        layout: the resolved layout.
    """
    from lightning_parallel.planner import memory
    from lightning_parallel.planner.from_config import expected_state_bytes, optimizer_states, state_shape

    try:
        module, deferred = _meta_model(cfg)
        candidate, kind = layout_candidate(strategy, layout)
        precision = str(cfg.trainer.get("precision", "32-true"))
        width = {"bf16-true": 2, "16-true": 2, "64-true": 8, "64": 8}.get(precision, 4)
        shape = state_shape(module, candidate.pp > 1, optimizer_states(cfg), width)
        on_meta = deferred and (kind == "hybrid" or (kind == "deepspeed" and candidate.zero == 3))
        shape = replace(shape, built_on_meta=on_meta) if hasattr(shape, "built_on_meta") else shape
        params, grads, optim = expected_state_bytes(shape, candidate)
    except Exception as error:  # noqa: BLE001 - the table describes the run; it never stops it
        return {"memory / rank": f"not estimated ({type(error).__name__}: {str(error).splitlines()[0][:120]})"}
    optimizer = str(cfg.model.get("optimizer", {}).get("_target_", "AdamW")).rsplit(".", 1)[-1]
    held = [f"parameters {_size(params)}", f"gradients {_size(grads)}",
            f"optimizer state {_size(optim)} ({optimizer}: {shape.optimizer_states} per parameter)"]
    setup = getattr(memory, "setup_bytes", None)  # the peak while the model is built and split
    if setup is not None and hasattr(shape, "built_on_meta"):
        ranks = [[i for stage in rank for i in stage] for rank in memory.stage_layers(shape, candidate)]
        held.append(f"setup peak {_size(max(setup(shape, candidate, layers) for layers in ranks))}")
    offload = [what for what, flag in (("optimizer state", "offload_optimizer"), ("parameters", "offload_parameters"))
               if getattr(strategy, flag, False)]
    note = "expected on the most loaded rank, activations not counted" + "".join(f"; {w} on CPU" for w in offload)
    return {
        "model": f"{shape.name}, {shape.num_params / 1e6:.3g}M parameters ({_size(shape.num_params * width)})",
        "model build": _build_description(kind, deferred, candidate.zero),
        "memory / rank": ", ".join(held) + f"  ({note})",
    }


def readable(value: Any) -> str:
    """A number as a person reads it: ``—`` for NaN, ``4.0e-4`` below 0.01, four decimals up to 10, one decimal up to
    10,000, thousands separated above; whole numbers without decimals; anything else as ``str``.

    Args:
        value: a metric (float, int, or anything printable).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if math.isnan(value):
        return "—"
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    size = abs(value)
    if float(value).is_integer() and size < 1e15:
        return f"{int(value):,}" if size >= 1e4 else str(int(value))
    if size < 1e-2:
        return f"{value:.1e}".replace("e-0", "e-").replace("e+0", "e+")  # 4.0e-4, not 4.0e-04
    if size < 10:
        return f"{value:.4f}"
    return f"{value:.1f}" if size < 1e4 else f"{value:,.0f}"


def result_rows(trainer: Any, metrics: dict[str, float], cfg: Any) -> list[tuple[str, str]]:
    """The one end-of-run table: losses, training throughput, evaluation figures, readouts, checkpoint.

    Each figure appears once: ``throughput/*`` (the run's one training-throughput measurer) and the
    evaluation report's ``eval/*`` rows, shown without their prefixes, then the text readouts.

    Args:
        trainer: the Trainer after ``fit``.
        metrics: :func:`fit_metrics` of the run.
        cfg: the run's config (``paths.checkpoint_dir``).
    """
    from pathlib import Path

    from lightning_parallel.cli.run_resume import last_checkpoint

    rows = [(key.split("/", 1)[1] if key.startswith("eval/") else key, readable(value))
            for key, value in sorted(metrics.items())]
    for callback in trainer.callbacks:
        readout = getattr(callback, "readout", None) or {}
        rows += [(name, str(value)) for name, value in readout.items() if not isinstance(value, (int, float))]
    callback = trainer.checkpoint_callback
    best = getattr(callback, "best_model_path", "") if callback else ""
    last = last_checkpoint(Path(str(cfg.paths.checkpoint_dir)))
    if best:
        rows.append(("checkpoint (best)", best))
    rows.append(("checkpoint (last)", str(last) if last else "- (none written)"))
    return rows
