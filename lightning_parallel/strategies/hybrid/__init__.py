"""The hybrid strategy's room: data x context x pipeline x tensor x expert parallelism on one mesh.

:mod:`.strategy` is Lightning's lifecycle; beside it the pieces only it uses: :mod:`.executors` (how a step runs),
:mod:`.after_backward` (expert reduction, replica commit), :mod:`.checkpoints`, :mod:`.clipping`, :mod:`.presets`
(the pipeline-, tensor- and context-only names), :mod:`.timeouts`, and the start-up and resume notices.
"""

from lightning_parallel.strategies.hybrid.strategy import CollectiveTimeout, HybridParallelStrategy

__all__ = ["CollectiveTimeout", "HybridParallelStrategy"]
