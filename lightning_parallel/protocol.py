"""The contract between a recipe's LightningModule and this suite's strategies.

A module that implements these methods trains unchanged under Lightning's own
single-device and DDP strategies (they simply ignore them) and under every strategy of
this suite, which use them to split the model:

* ``pipeline_layers()`` -- the ordered blocks a pipeline cuts into stages;
* ``pipeline_loss(output, target)`` -- the loss the last pipeline stage computes;
* ``pipeline_split_batch(batch)`` -- how a batch splits into model input and target;
* ``tensor_parallel_plan()`` -- which submodules tensor parallelism shards, and how.

Recipes import only this module from the suite (never ``strategies`` or ``parallel``).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn


@runtime_checkable
class PipelineModule(Protocol):
    """A module whose ``forward`` is a chain of layers that a pipeline can cut.

    Requirements a strategy relies on:

    * ``pipeline_layers()`` returns submodules of the module, in order, such that
      ``layers[-1](...layers[1](layers[0](inputs)))`` equals ``module(inputs)`` where
      ``inputs`` is the first element of ``pipeline_split_batch(batch)``. Each layer takes
      one tensor and returns one tensor. Keep the layers in containers whose names do not
      depend on the layout (for example ``blocks.0``, ``blocks.1``): checkpoint keys are
      those names, which is what lets a checkpoint load under another layout.
    * ``pipeline_loss(output, target)`` returns the scalar *mean* loss of one (micro)batch,
      so that the mean over equal micro-batches is the loss of the whole batch.
    """

    def pipeline_layers(self) -> list[nn.Module]: ...

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor: ...


@runtime_checkable
class TensorParallelModule(Protocol):
    """A module that declares how tensor parallelism shards it.

    ``tensor_parallel_plan()`` maps submodule names (fnmatch globs such as
    ``"blocks.*.mlp.up"`` allowed) to a torch ``ParallelStyle``
    (``ColwiseParallel()``, ``RowwiseParallel()``, ...) or a style name understood by the
    suite (``"colwise"``, ``"rowwise"``, ...). Reshape activations with ``-1`` for the
    sharded dimension (``view(B, T, -1, head_dim)``) so that a rank can hold a slice of
    the heads.
    """

    def tensor_parallel_plan(self) -> dict[str, Any]: ...


def split_batch(module: nn.Module, batch: Any) -> tuple[Any, Any]:
    """Split ``batch`` into ``(inputs, targets)`` the way ``module`` asks.

    Uses ``module.pipeline_split_batch`` when the module defines it; otherwise the batch
    must be an ``(inputs, targets)`` pair.

    Args:
        module: the LightningModule (or any module following the protocol).
        batch: one batch from the data loader.
    """
    custom = getattr(module, "pipeline_split_batch", None)
    if callable(custom):
        return custom(batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        f"Batches must be (inputs, targets) pairs, got {type(batch).__name__}"
        f"{' of length ' + str(len(batch)) if isinstance(batch, (tuple, list)) else ''}. "
        "Return pairs from the dataset, or define pipeline_split_batch(batch) -> (inputs, targets) on the module."
    )


def require_pipeline_module(module: nn.Module) -> None:
    """Raise a ``ValueError`` naming what is missing if ``module`` cannot be pipelined."""
    missing = [name for name in ("pipeline_layers", "pipeline_loss") if not callable(getattr(module, name, None))]
    if missing:
        raise ValueError(
            f"{type(module).__name__} cannot be split into pipeline stages: it lacks {', '.join(missing)}. "
            "Implement the module protocol (see lightning_parallel/protocol.py and the README)."
        )


def require_tensor_parallel_module(module: nn.Module) -> None:
    """Raise a ``ValueError`` if ``module`` declares no tensor-parallel plan."""
    if not callable(getattr(module, "tensor_parallel_plan", None)):
        raise ValueError(
            f"{type(module).__name__} has no tensor_parallel_plan(): define it (submodule name -> ParallelStyle) "
            "or pass plan= to the strategy."
        )
