"""How a step runs, chosen once in ``setup``: Lightning calls the module, or a pipeline schedule runs it.

:class:`DirectExecutor` lets Lightning call the module's own ``training_step`` & co. (tensor
and data parallelism change the parameters, not the step). :class:`PipelinedExecutor`
runs a ``torch.distributed.pipelining`` schedule instead: forward *and* backward for every
micro-batch inside ``training_step``, the loss logged from ``pipeline_loss``.

The strategy hands each method a ``default`` callable -- Lightning's own behaviour for that
hook -- so an executor either wraps it or replaces it, and the strategy never branches.

Losses over padded batches: wherever items carry unequal weight (``-100`` labels), the loss of
a global batch is ``sum(token losses) / sum(valid tokens)`` over its data-parallel ranks (and
micro-batches), the single-process loss. The direct executor gets this from the model
adapter's ``loss_weighting`` (a Hugging Face causal LM's own ``.loss``:
:mod:`lightning_parallel.adapters.hf.loss`); the pipelined one counts the valid items of the
whole batch over the data axis and hands the count to the schedule. Both ask the adapter the
run resolved once (``parallelized.adapter``), never the module's type.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_parallel.layout import PIPELINE_PARALLEL
from lightning_parallel.parallel.adapter import LossWeighting
from lightning_parallel.parallel.experts.sharded import ExpertParallel
from lightning_parallel.parallel.pipeline.runner import PipelineRunner, default_item_count
from lightning_parallel.parallel.pipeline.step_hooks import PipelineStep
from lightning_parallel.parallel.tensor.plan import loss_parallel_context

if TYPE_CHECKING:
    from lightning_parallel.parallel.compose import Parallelized

Default = Callable[[], Any]


def plain_loss(output: Any) -> Any:
    """A loss computed under loss_parallel is a replicated DTensor; Lightning needs a tensor.

    ``full_tensor()`` of a replicated DTensor is differentiable and communication-free.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(output, DTensor):
        return output.full_tensor()
    if isinstance(output, Mapping) and isinstance(output.get("loss"), DTensor):
        return {**output, "loss": output["loss"].full_tensor()}
    return output


class DirectExecutor:
    """Lightning calls the module's steps; loss parallelism wraps them and unwraps a DTensor loss.

    Args:
        loss_parallel: whether the LM head's logits stay vocabulary-sharded.
        weighting: makes the model's own loss the global-batch mean over the data-parallel ranks
            during training steps (the adapter's ``loss_weighting``); None: off.
    """

    def __init__(self, loss_parallel: bool = False, weighting: Optional[LossWeighting] = None) -> None:
        self.loss_parallel = loss_parallel
        self.weighting = weighting

    def _context(self) -> ContextManager[None]:
        return loss_parallel_context(True) if self.loss_parallel else nullcontext()

    def training_step(self, default: Default, batch: Any, batch_idx: int) -> Any:
        with self._context(), (self.weighting.training() if self.weighting is not None else nullcontext()):
            return plain_loss(default())

    def evaluation_step(self, default: Default, batch: Any, name: str) -> Any:
        # Weighted as in training: a validation loss over padded batches is the global token mean too (under
        # context parallelism each rank would otherwise report the mean of its share of the sequence).
        with self._context(), (self.weighting.training() if self.weighting is not None else nullcontext()):
            return plain_loss(default())

    def predict_step(self, default: Default, batch: Any) -> Any:
        return default()

    def backward(self, default: Default, closure_loss: Tensor) -> Tensor:
        with self._context():
            return default()


class PipelinedExecutor(DirectExecutor):
    """Runs the pipeline schedule for every step; Lightning's hooks around it are kept.

    Args:
        strategy: the strategy (its ``lightning_module``, ``precision_plugin``, ``root_device``,
            ``device_mesh``, ``pre_backward``/``post_backward`` are used).
        parallelized: the result of :func:`~lightning_parallel.parallel.compose.parallelize`.
    """

    def __init__(self, strategy: Any, parallelized: Parallelized) -> None:
        super().__init__(parallelized.options.loss_parallel)
        options = parallelized.options
        self.strategy = strategy
        # The loss averages over data replicas x context ranks (each holds a share of every sequence).
        self.dp_group, self.data_parallel = strategy.loss_group()
        module = strategy.lightning_module
        self.adapter = parallelized.adapter
        # Terms (loss_sum, num_items) as the adapter's pipeline plan said: the module's
        # pipeline_loss_terms, or a causal LM's token-weighted loss.
        self.loss_terms = parallelized.loss_terms
        self.parallelized_options = options
        self.count_items = parallelized.count_items or default_item_count
        self.runner = PipelineRunner(
            parallelized.stages,
            parallelized.stage_ids,
            parallelized.num_stages,
            options.schedule,
            options.microbatches,
            loss_fn=parallelized.loss_fn or module.pipeline_loss,
            device=strategy.root_device,
            group=strategy.meshes.group(PIPELINE_PARALLEL),
            last_stage_rank=parallelized.last_stage_rank,
            data_parallel_size=self.data_parallel,
            count_items=self.count_items,
        )
        self._parked: list[tuple[Tensor, Tensor]] = []
        for layer in module.modules():  # the first step's expert-load report counts the schedule's forwards only
            if isinstance(layer, ExpertParallel):
                layer.counts_forward = self.runner.in_microbatch_forward
        # A term over the whole step the stages' chain does not carry (step_hooks.py): the module's or the adapter's.
        self.step_hooks = self.adapter.pipeline_step_hooks(parallelized.stages, parallelized.layout)

    def _num_items(self, targets: Any) -> Optional[Tensor]:
        """Items carrying a loss in the whole global batch: this rank's count summed over the data axis.

        None for a per-micro-batch mean loss (``pipeline_loss``), which needs no count. Every
        data-parallel rank of a pipeline rank calls this at the same point of every step.
        """
        if not self.loss_terms:
            return None
        count = self.count_items(targets).to(device=self.strategy.root_device, dtype=torch.int64)
        if self.dp_group is not None:
            dist.all_reduce(count, group=self.dp_group)
        return count

    def _data_parallel_mean(self, value: Tensor) -> Tensor:
        if self.dp_group is None:
            return value
        value = value.clone()
        dist.all_reduce(value, group=self.dp_group)
        return value / self.data_parallel

    def training_step(self, default: Default, batch: Any, batch_idx: int) -> Any:
        module = self.strategy.lightning_module
        inputs, targets = self.adapter.split_batch(batch)
        accumulation = module.trainer.accumulate_grad_batches
        if batch_idx % accumulation == 0:
            # First batch of an accumulation window: Lightning zeroes the gradients only
            # after this step has run backward, so start the window from zero here.
            for param in module.parameters():
                param.grad = None
        num_items = self._num_items(targets)
        step = self._step(1.0 / accumulation)
        begin, end = self.step_hooks
        if begin is not None:
            begin(step)
        with self.strategy.precision_plugin.train_step_context(), self._context():
            loss = self.runner.train_step(inputs, targets, loss_scale=step.loss_scale, num_items=num_items)
        extra = end(step) if end is not None else None
        self._park_gradients()
        loss = self._data_parallel_mean(loss)
        module.log("train_loss", loss, prog_bar=True)  # the model output's loss, as training_step would log it
        return loss if extra is None else loss + extra.to(loss.device, loss.dtype)

    def _step(self, loss_scale: float) -> PipelineStep:
        """What the module's pipeline-step hooks get for one step (:mod:`~.pipeline.step_hooks`)."""
        options = self.parallelized_options
        return PipelineStep(options.microbatches, options.schedule, loss_scale, self.dp_group, self.data_parallel,
                            self.runner.group, self.runner.in_microbatch_forward)

    def evaluation_step(self, default: Default, batch: Any, name: str) -> Any:
        module = self.strategy.lightning_module
        inputs, targets = self.adapter.split_batch(batch)
        num_items = self._num_items(targets)
        with self.strategy.precision_plugin.val_step_context(), self._context():
            loss, _ = self.runner.eval_step(inputs, targets, num_items=num_items)
        module.log(name, loss, prog_bar=name == "val_loss", sync_dist=True)
        return loss

    def predict_step(self, default: Default, batch: Any) -> Any:
        inputs = self.adapter.split_batch(batch)[0] if isinstance(batch, (tuple, list)) else batch
        with self.strategy.precision_plugin.predict_step_context():
            _, outputs = self.runner.eval_step(inputs, None)
        return self.runner.broadcast_outputs(outputs)

    def backward(self, default: Default, closure_loss: Tensor) -> Tensor:
        # The schedule already ran backward for every micro-batch: hand the parked
        # gradients back and run Lightning's hooks around a backward that is not needed.
        strategy, module = self.strategy, self.strategy.lightning_module
        strategy.pre_backward(closure_loss)
        self._restore_gradients()
        closure_loss = strategy.precision_plugin.pre_backward(closure_loss, module)
        closure_loss = strategy.precision_plugin.post_backward(closure_loss, module)
        strategy.post_backward(closure_loss)
        return closure_loss

    def _park_gradients(self) -> None:
        """Hide the gradients the schedule just computed from Lightning's ``zero_grad``.

        Note:
            Lightning's closure runs ``training_step``, then ``zero_grad`` (on the first batch
            of an accumulation window), then ``backward``. A pipeline schedule runs forward
            *and* backward inside ``training_step``, so its gradients would be wiped. They are
            parked here (references, no copies) and handed back in :meth:`backward`, which
            leaves accumulation exact: a later batch's schedule adds to the parked sum.
        """
        self._parked = []
        for param in self.strategy.lightning_module.parameters():
            if param.grad is not None:
                self._parked.append((param, param.grad))
                param.grad = None

    def _restore_gradients(self) -> None:
        for param, grad in self._parked:
            param.grad = grad if param.grad is None else param.grad + grad
        self._parked = []


def choose_executor(strategy: Any, parallelized: Optional[Parallelized]) -> DirectExecutor:
    """The pipelined executor when the module was cut into stages, else the direct one.

    The direct one weights the model's own loss over the data-parallel ranks when the adapter
    says how (``ModelAdapter.loss_weighting``: a Hugging Face causal LM's token mean).
    """
    if parallelized is not None and parallelized.pipelined:
        return PipelinedExecutor(strategy, parallelized)
    if parallelized is None:
        return DirectExecutor()
    module = strategy.lightning_module
    weighting = None
    group, size = strategy.loss_group()  # data replicas x context ranks
    if size > 1:
        accumulation = module.trainer.accumulate_grad_batches
        weighting = parallelized.adapter.loss_weighting(group, size, accumulation, warn=strategy.global_rank == 0)
    return DirectExecutor(parallelized.options.loss_parallel, weighting)
