"""The contract between a LightningModule and this suite's strategies (duck-typed: no base class).

A module that implements these methods trains unchanged under Lightning's own
single-device and DDP strategies (they simply ignore them) and under every strategy of
this suite, which use them to split the model:

* ``pipeline_layers()`` -- the ordered blocks a pipeline cuts into stages. They must be
  submodules of the module such that ``layers[-1](...layers[1](layers[0](inputs)))``
  equals ``module(inputs)``, where ``inputs`` is the first element of
  ``pipeline_split_batch(batch)``. A layer takes one or more tensors and returns a tensor
  or a tuple of tensors; a tuple is handed to the next layer as positional arguments
  (and across a stage boundary each of its tensors is sent). Tuple ``inputs`` are
  likewise unpacked into the first layer. Keep the layers in containers whose names do
  not depend on the layout (``blocks.0``, ``blocks.1``): checkpoint keys are those names,
  which is what lets a checkpoint load under another layout. Two layers may share a
  parameter (tied embeddings): on two pipeline ranks the copies are kept identical.
  Before the split the chain is run once against ``forward`` on
  ``example_input_array`` (when the module sets it) and a mismatch is an error.
* ``pipeline_side_inputs(inputs)`` -- optional: ``{name: tensor}`` of batch-first tensors
  that several layers need but no layer computes (a padding mask, position ids). They
  are split per micro-batch like the batch and every layer whose ``forward`` accepts a
  keyword of that name (or ``**kwargs``) receives its micro-batch's slice on every stage.
* ``pipeline_loss(output, target)`` -- the scalar *mean* loss of one (micro)batch, so that
  the mean over equal micro-batches is the loss of the whole batch.
* ``pipeline_loss_terms(output, target)`` -- optional, preferred over ``pipeline_loss``
  wherever items carry unequal weight (padding, ``-100`` labels, prompt masking): returns
  ``(loss_sum, num_items)`` of one (micro)batch, and the suite takes the loss of a global
  batch as ``sum(loss_sum) / sum(num_items)`` over all its micro-batches and data-parallel
  ranks -- the single-process loss -- instead of averaging per-micro-batch means.
* ``pipeline_split_batch(batch)`` -- how a batch splits into model input and target
  (default: an ``(inputs, targets)`` pair; for a module holding a Hugging Face model, a
  dict batch splits into the dict without ``labels`` and the ``labels``).
* ``tensor_parallel_plan()`` -- submodule names (fnmatch globs such as ``"blocks.*.mlp.up"``
  allowed) mapped to a torch ``ParallelStyle`` or a style name of
  :data:`lightning_parallel.parallel.tensor.plan.STYLE_NAMES`. Reshape activations with ``-1``
  for the sharded dimension (``view(B, T, -1, head_dim)``) so a rank can hold a slice of
  the heads.

A module that defines none of the pipeline methods but holds a Hugging Face decoder-only
causal LM is split from the model's own pipeline plan (:mod:`lightning_parallel.adapters.hf_pipeline`),
with ``transformers``' causal-LM loss taken as token-weighted terms.

The recipes under ``examples/`` implement these methods without importing anything from
the suite but :mod:`lightning_parallel.resumable_loader` (never ``strategies`` or
``parallel``), so they also run under Lightning's own strategies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_parallel.adapters.hf import find_hf_model


def split_batch(module: nn.Module, batch: Any) -> tuple[Any, Any]:
    """Split ``batch`` into ``(inputs, targets)`` the way ``module`` asks.

    Uses ``module.pipeline_split_batch`` when the module defines it; otherwise a dict batch
    of a module holding a Hugging Face model splits into ``(the dict without "labels",
    labels)``, and any other batch must be an ``(inputs, targets)`` pair.

    Args:
        module: the LightningModule (or any module following the protocol).
        batch: one batch from the data loader.
    """
    custom = getattr(module, "pipeline_split_batch", None)
    if callable(custom):
        return custom(batch)
    if isinstance(batch, Mapping) and find_hf_model(module) is not None:
        if "labels" not in batch:
            raise ValueError(
                f"The batch holds {sorted(batch)} but no 'labels': a Hugging Face causal LM's pipeline needs the labels "
                "as targets. Add labels to the batch (input_ids with -100 where no loss is taken), or define "
                "pipeline_split_batch(batch) -> (inputs, targets) on the module."
            )
        return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        f"Batches must be (inputs, targets) pairs, got {type(batch).__name__}"
        f"{' of length ' + str(len(batch)) if isinstance(batch, (tuple, list)) else ''}. "
        "Return pairs from the dataset, or define pipeline_split_batch(batch) -> (inputs, targets) on the module."
    )


def require_pipeline_module(module: nn.Module) -> None:
    """Raise a ``ValueError`` naming what is missing if ``module`` cannot be pipelined.

    A module defining ``pipeline_layers()`` needs a loss (``pipeline_loss_terms`` or
    ``pipeline_loss``); one holding a Hugging Face model is checked by its adapter.
    """
    from lightning_parallel.adapters.pipeline_plan import pipeline_plan

    pipeline_plan(module)
