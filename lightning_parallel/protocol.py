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
  (default: an ``(inputs, targets)`` pair; a model adapter may know better -- for a module
  holding a Hugging Face model, a dict batch splits into the dict without ``labels`` and the
  ``labels``).
* ``tensor_parallel_plan()`` -- submodule names (fnmatch globs such as ``"blocks.*.mlp.up"``
  allowed) mapped to a torch ``ParallelStyle`` or a style name of
  :data:`lightning_parallel.parallel.tensor.plan.STYLE_NAMES`. Reshape activations with ``-1``
  for the sharded dimension (``view(B, T, -1, head_dim)``) so a rank can hold a slice of
  the heads.

A module that defines none of these methods may still be split when a model adapter
understands it (:func:`lightning_parallel.adapters.adapt`): a Hugging Face decoder-only causal LM
is split from the model's own pipeline plan, with ``transformers``' causal-LM loss taken as
token-weighted terms. This module knows only the protocol; the adapters build on it.

The recipes under ``examples/`` implement these methods without importing anything from
the suite but :mod:`lightning_parallel.resumable_loader` (never ``strategies`` or
``parallel``), so they also run under Lightning's own strategies.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def split_batch(module: nn.Module, batch: Any) -> tuple[Any, Any]:
    """Split ``batch`` into ``(inputs, targets)`` the way ``module`` asks.

    Uses ``module.pipeline_split_batch`` when the module defines it; otherwise the model's
    adapter decides (a Hugging Face model's dict batch splits into ``(the dict without
    "labels", labels)``), and any other batch must be an ``(inputs, targets)`` pair. Callers
    that already hold the run's adapter ask it directly (``adapter.split_batch(batch)``).

    Args:
        module: the LightningModule (or any module following the protocol).
        batch: one batch from the data loader.
    """
    from lightning_parallel.parallel.adapter import ModelAdapter  # the engine's vocabulary; no adapter imported

    return ModelAdapter.resolve(module).split_batch(batch)
