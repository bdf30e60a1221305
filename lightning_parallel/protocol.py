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
* ``pipeline_step_begin(step)`` and ``pipeline_step_end(step)`` -- optional, for a term over the whole step
  that the stages' chain does not carry (a router's balancing loss): called on every rank before and after
  each training schedule with a :class:`~lightning_parallel.parallel.pipeline.step_hooks.PipelineStep` (the
  data and pipeline groups, micro-batches, schedule); a scalar ``pipeline_step_end`` returns (the same on every
  rank) is added to the step's loss, whose gradient the module put in place during the schedule.
* ``pipeline_split_batch(batch)`` -- how a batch splits into model input and target
  (default: an ``(inputs, targets)`` pair; a model adapter may know better -- for a module
  holding a Hugging Face model, a dict batch splits into the dict without ``labels`` and the
  ``labels``). The suite asks the run's adapter: ``lightning_parallel.adapters.adapt(module).split_batch(batch)``.
* ``tensor_parallel_plan()`` -- submodule names (fnmatch globs such as ``"blocks.*.mlp.up"``
  allowed) mapped to a torch ``ParallelStyle`` or a style name of
  :data:`lightning_parallel.parallel.tensor.plan.STYLE_NAMES`. Reshape activations with ``-1``
  for the sharded dimension (``view(B, T, -1, head_dim)``) so a rank can hold a slice of
  the heads.

Built on the meta device (``configure_model`` under the suite's strategies): every module that owns
parameters or buffers is initialised on its own with ``reset_parameters()`` (torch's convention),
from a random stream seeded by ``(seed, its name)`` -- so the initial weights are the same under
every layout, and :func:`seeded_init` gives a model built eagerly (under Lightning's own strategies)
the same values. A module with tensors and no ``reset_parameters()`` is refused before anything is
allocated.

A module that defines none of these methods may still be split when a model adapter
understands it (:func:`lightning_parallel.adapters.adapt`): a Hugging Face decoder-only causal LM
is split from the model's own pipeline plan, with ``transformers``' causal-LM loss taken as
token-weighted terms. This module knows only the protocol and imports nothing of the suite's (no adapter, nothing
of :mod:`lightning_parallel.parallel`): the adapters and the engine build on it.

The recipes under ``examples/`` implement these methods without importing anything from
the suite but :mod:`lightning_parallel.resumable_loader` (never ``strategies`` or
``parallel``), so they also run under Lightning's own strategies.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Callable

import torch
from torch import Tensor, nn


#: ``init(name, module)`` initialises one module's own (direct) parameters and buffers in place, at full size,
#: on the CPU; ``name`` is the module's name in the unsplit model (``module`` may be a copy).
InitFn = Callable[[str, nn.Module], None]

def reset_parameters(name: str, module: nn.Module) -> None:
    """The protocol's initialiser: torch's convention, ``module.reset_parameters()``.

    Args:
        name: the module's name in the unsplit model (for the message).
        module: the module (or its copy) to initialise.

    Raises:
        ValueError: the module owns parameters or buffers but defines no ``reset_parameters()``.
    """
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        owned = [attr for attr, _ in module.named_parameters(recurse=False)]
        owned += [attr for attr, _ in module.named_buffers(recurse=False)]
        raise ValueError(
            f"{name or 'the root module'} ({type(module).__name__}) owns {owned} but defines no reset_parameters(): "
            "built on the meta device, its "
            "values cannot be initialised after the split. Give it a reset_parameters() that fills exactly these "
            "(torch's convention, as nn.Linear does), or build the model in __init__ instead of configure_model."
        )
    reset()


def layer_seed(seed: int, name: str) -> int:
    """The seed of the module called ``name``: a hash of ``(seed, name)``, the same on every rank and layout."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def owned_tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    """``(attribute, tensor)`` of the parameters and buffers ``module`` owns itself (not its children's)."""
    return [(a, t) for a, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            if t is not None]


def seeded_init(module: nn.Module, seed: int, init: InitFn = reset_parameters) -> None:
    """Give an eagerly built ``module`` the initial values :func:`materialize` gives it under any layout.

    Parameters DeepSpeed ZeRO-3 partitioned at construction (``zero.Init``) are gathered whole around each
    module's initialiser and partitioned again (``GatheredParameters``): the same values, one module at a time.

    Args:
        module: a whole model with storage (every rank builds it the same way).
        seed: the seed the parallel runs use.
        init: the same initialiser the parallel runs use.
    """
    seen: set[int] = set()
    for owner_name, owner in module.named_modules():
        owned = [t for _, t in owned_tensors(owner)]
        if all(id(t) in seen for t in owned):
            continue
        with _gathered([t for t in owned if hasattr(t, "ds_id")]), torch.random.fork_rng(devices=[]), torch.no_grad():
            kept = [(t, t.detach().clone()) for t in owned if id(t) in seen]  # tied: their first owner's value stays
            torch.manual_seed(layer_seed(seed, owner_name))
            init(owner_name, owner)
            for tensor, value in kept:
                tensor.copy_(value)
        seen.update(id(t) for t in owned)


def _gathered(partitioned: list[Tensor]) -> Any:
    """DeepSpeed's ``GatheredParameters`` (rank 0's values kept) around ZeRO-3-partitioned tensors, else nothing."""
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0)
