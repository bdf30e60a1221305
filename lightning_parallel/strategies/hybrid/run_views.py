"""What the hybrid strategy answers about its run besides Lightning's lifecycle (a mixin of the strategy).

The layout it will run (asked before any process exists: ``lp-train``'s preflight, ``lp-compare``), its start-up
rows, the run's meshes and loss group, the pipeline split and runner, and the model's adapter. Kept apart so
:mod:`.strategy` reads as Lightning's hooks only.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_parallel.adapters import ModelAdapter
from lightning_parallel.layout import ParallelLayout
from lightning_parallel.layout.meshes import RunMeshes
from lightning_parallel.parallel.pipeline.stages import PipelineSplit
from lightning_parallel.strategies.module_adapter import strategy_adapter

__all__ = ["HybridRunViews"]


class HybridRunViews:
    """The hybrid strategy's answers about its run (mixed in before Lightning's ``ModelParallelStrategy``); it reads
    the strategy's ``options``, ``parallelized``, ``_meshes``, ``_executor`` and ``_parallelized_module``."""

    def resolve_layout(
        self, world_size: int, names: Optional[dict[str, str]] = None, num_nodes: Optional[int] = None
    ) -> ParallelLayout:
        """The data x pipeline x tensor layout for ``world_size`` ranks (no processes needed).

        Args:
            world_size: processes in the run.
            names: how errors spell the settings (default: this strategy's argument names).
            num_nodes: nodes in the run, for the messages (default: the strategy's).
        """
        return self.options.layout(world_size, names, num_nodes or self.num_nodes)

    def startup_rows(self, layout: ParallelLayout) -> dict[str, str]:
        """Strategy rows of the start-up table (see :mod:`lightning_parallel.cli.report`)."""
        from lightning_parallel.strategies.hybrid.startup_rows import layout_rows

        return layout_rows(self.options, layout, str(self.precision_plugin.precision))

    @property
    def meshes(self) -> RunMeshes:
        """Every mesh and process group of the run, asked by axis name (after ``setup_environment``)."""
        if self._meshes is None:
            raise RuntimeError("The meshes exist only after setup_environment (once processes are initialised).")
        return self._meshes

    def loss_group(self) -> tuple[Optional[Any], int]:
        """``(group, size)`` of the ranks a loss is averaged over (data x context; see ``RunMeshes.loss_group``)."""
        return self.meshes.loss_group()

    @property
    def pipeline_split(self) -> Optional[PipelineSplit]:
        """Which layers each pipeline stage owns (None without pipelining or before ``setup``)."""
        return getattr(self.parallelized, "split", None)

    @property
    def pipeline_runner(self) -> Any:  # the executor's PipelineRunner (parallel/pipeline/runner.py); None without
        return getattr(self._executor, "runner", None)

    @property
    def _built_for_this_module(self) -> bool:
        return self._parallelized_module is not None and self._parallelized_module() is self.lightning_module

    @property
    def adapter(self) -> ModelAdapter:
        """What answers for the module being trained (``lightning_parallel.adapters.adapt``), resolved once per module
        and again in ``setup``, after ``configure_model`` may have built the model inside it."""
        return strategy_adapter(self)
