"""The hybrid strategy's one call into the engine: the module split, sharded and wrapped for this rank.

Kept out of :mod:`.strategy` so that module reads as Lightning's lifecycle: here is what ``setup`` needs before
:func:`~lightning_parallel.parallel.compose.parallelize` can run (the adapter of what ``configure_model`` built, the
layer times every rank agrees on, one initialisation seed) and what it does with the optimizers afterwards.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_parallel.parallel.compose import BuildSettings, Parallelized, parallelize
from lightning_parallel.parallel.local_step import step_on_local_shards
from lightning_parallel.parallel.materialize import Materialization
from lightning_parallel.parallel.pipeline import tied as pipeline_tied
from lightning_parallel.parallel.pipeline.chain_check import on_meta
from lightning_parallel.parallel.pipeline.stages import PipelineSplit
from lightning_parallel.strategies.hybrid.checkpoints import unwrap_optimizer
from lightning_parallel.strategies.hybrid.layer_timing import agreed_layer_times
from lightning_parallel.strategies.module_adapter import strategy_adapter

__all__ = ["build_parallelized", "prepare_optimizers"]


def build_parallelized(strategy: Any, module: pl.LightningModule, trainer: pl.Trainer) -> Parallelized:
    """``parallelize(module, ...)`` with everything the strategy knows (every rank calls this).

    Args:
        strategy: the ``HybridParallelStrategy`` after ``setup_environment`` (its meshes, options, precision).
        module: the LightningModule, after ``configure_model``.
        trainer: the Trainer (its loaders time the layers under ``partition="time"``).

    Raises:
        ValueError: ``partition="time"`` on a model built on meta (nothing to time).
    """
    layout, options = strategy.layout, strategy.options
    adapter = strategy_adapter(strategy, refresh=True)  # after configure_model: what it built
    timed = layout.pipeline_parallel_enabled and options.partition == "time"
    if timed and on_meta(module):
        raise ValueError("partition='time' times each layer, but the model is on the meta device (built in "
                         "configure_model): use partition='parameters' or explicit cut points.")
    times = agreed_layer_times(adapter, trainer, options.microbatches, strategy.root_device,
                               strategy.world_size) if timed else None
    seed = int(strategy.broadcast(torch.initial_seed()))  # meta init: one seed on every rank, seeded or not
    if not on_meta(module) and (layout.world_size > layout.data_parallel or options.zero_stage == 3):
        rank_zero_info(f"lightning_parallel: {type(module).__name__} was built with storage, so every rank held "
                       "the whole model before the split; build it in configure_model() to hold only its share.")
    build = BuildSettings(str(strategy.precision_plugin.precision), Materialization(strategy.root_device, seed), times,
                          lambda split: _print_split(strategy, split))
    parallelized = parallelize(module, meshes=strategy.meshes, options=options, adapter=adapter, build=build)
    if parallelized.float8 is not None:  # never silently: which Linear layers stay in high precision, and why
        from lightning_parallel.parallel.float8.checks import torchao_version

        rank_zero_info(parallelized.float8.notice(torchao_version()))
    return parallelized


def _print_split(strategy: Any, split: PipelineSplit) -> None:
    if strategy.global_rank == 0:
        from lightning_parallel.runtime.console import print_table

        print_table("lightning_parallel: pipeline split", list(split.describe().items()))


def prepare_optimizers(strategy: Any, trainer: pl.Trainer) -> None:
    """Build the optimizers on the parallelised parameters and check what parallelism asks of them.

    DTensor parameters step on their local tensors (element-wise optimizers); tied weights split across pipeline
    stages must sit in the same optimizer group on every stage (a collective: the same on every rank).

    Args:
        strategy: the ``HybridParallelStrategy`` in ``setup``, after ``parallelize``.
        trainer: the Trainer (``configure_optimizers`` runs through it).
    """
    strategy.setup_optimizers(trainer)
    optimizers, split = [unwrap_optimizer(o) for o in strategy.optimizers], strategy.parallelized.split
    step_on_local_shards(optimizers)
    if split is not None and split.shared:
        pipeline_tied.check_tied_optimizer_groups(strategy.lightning_module, strategy.parallelized.tied, optimizers)
