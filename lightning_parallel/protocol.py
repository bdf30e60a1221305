"""The contract between a LightningModule and this suite's strategies (duck-typed: no base class).

A module that implements these methods trains unchanged under Lightning's own
single-device and DDP strategies (they simply ignore them) and under every strategy of
this suite, which use them to split the model:

* ``pipeline_layers()`` -- the ordered blocks a pipeline cuts into stages. They must be
  submodules of the module such that ``layers[-1](...layers[1](layers[0](inputs)))``
  equals ``module(inputs)``, where ``inputs`` is the first element of
  ``pipeline_split_batch(batch)``; each layer takes one tensor and returns one tensor.
  Keep the layers in containers whose names do not depend on the layout (``blocks.0``,
  ``blocks.1``): checkpoint keys are those names, which is what lets a checkpoint load
  under another layout.
* ``pipeline_loss(output, target)`` -- the scalar *mean* loss of one (micro)batch, so that
  the mean over equal micro-batches is the loss of the whole batch.
* ``pipeline_loss_terms(output, target)`` -- optional, preferred over ``pipeline_loss``
  wherever items carry unequal weight (padding, ``-100`` labels, prompt masking): returns
  ``(loss_sum, num_items)`` of one (micro)batch, and the suite takes the loss of a global
  batch as ``sum(loss_sum) / sum(num_items)`` over all its micro-batches and data-parallel
  ranks -- the single-process loss -- instead of averaging per-micro-batch means.
* ``pipeline_split_batch(batch)`` -- how a batch splits into model input and target
  (default: an ``(inputs, targets)`` pair).
* ``tensor_parallel_plan()`` -- submodule names (fnmatch globs such as ``"blocks.*.mlp.up"``
  allowed) mapped to a torch ``ParallelStyle`` or a style name of
  :data:`lightning_parallel.parallel.tensor.STYLE_NAMES`. Reshape activations with ``-1``
  for the sharded dimension (``view(B, T, -1, head_dim)``) so a rank can hold a slice of
  the heads.

The recipes under ``examples/`` implement these methods without importing anything from
the suite but :mod:`lightning_parallel.resumable_loader` (never ``strategies`` or
``parallel``), so they also run under Lightning's own strategies.
"""

from __future__ import annotations

from typing import Any

from torch import nn


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
