"""A layout's arithmetic on one process: its micro-batches, its data shards and its tensor splits, no communication.

Each layout sums the same numbers in another order. :func:`train_in_order` trains a model on one process with the
order of one layout, so that the model's *floor* under that layout (:mod:`.floor`, ``benchmarks/drift_study.py``)
is how far one process drifts from itself when only that order changes:

* **pipeline** (``pp2``): the global batch cut into the schedule's micro-batches; each micro-batch's summed token
  loss is multiplied by ``1 / N`` (``N`` the global batch's valid tokens) and back-propagated, the gradients
  accumulating -- what :class:`~lightning_parallel.parallel.pipeline.runner.PipelineRunner` does with loss terms;
* **data** (``dp2_zero2``, ``dp2_ep2``): the batch dealt to the data ranks (rank ``r`` serves rows ``r, r + dp,
  ...``, as the loader's distributed sampler deals them); each shard's summed token loss
  is divided by ``N / dp`` (what the suite's token weighting passes as ``num_items_in_batch``, and what the GPT
  recipe's ``global_token_mean`` divides by), its gradients taken alone, then averaged over the shards as the
  gradient reduction does;
* **tensor** (``tp2``): every Linear the model's tensor plan splits computes as two shards: a column-split layer
  as two half-width products concatenated (its input gradient the sum of the two halves' contributions, as the
  all-reduce sums them), a row-split layer as the sum of two half-depth partial products (the forward all-reduce).
  Embedding splits add zeros and are exact; the suite's own styles (per-head sums, MLA) are left whole.

The whole-batch order is the one-process run itself (a Hugging Face model's ``model(**batch).loss``, the GPT
recipe's token mean) with the module's own ``configure_optimizers``: the loop reproduces it to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor, nn

MICROBATCHES = 4  # the matrix's and the drift study's pipeline micro-batches


@dataclass(frozen=True)
class Arithmetic:
    """The order in which one layout sums a step's numbers.

    Attributes:
        microbatches: pipeline micro-batches per data shard (1: none).
        data_shards: data-parallel ranks whose gradients are averaged (1: none).
        tensor: whether the tensor plan's Linear layers compute as two shards.
    """

    microbatches: int = 1
    data_shards: int = 1
    tensor: bool = False


#: Each matrix layout's arithmetic (data 2 x expert 2 routes tokens to the rank holding their expert, which leaves
#: each token's expert product as it is: its order is data parallelism's).
ARITHMETIC: dict[str, Arithmetic] = {
    "single": Arithmetic(), "tp2": Arithmetic(tensor=True), "pp2": Arithmetic(microbatches=MICROBATCHES),
    "pp2xtp2": Arithmetic(microbatches=MICROBATCHES, tensor=True), "dp2_zero2": Arithmetic(data_shards=2),
    "dp2_ep2": Arithmetic(data_shards=2),
}


@dataclass(frozen=True)
class Objective:
    """How one kind of model turns a batch into the loss each order back-propagates.

    Attributes:
        whole: ``(module, batch) -> loss`` of one process (what its ``training_step`` computes alone).
        terms: ``(module, batch) -> summed token loss`` of a micro-batch.
        count: ``batch -> tokens carrying a loss`` (float32).
        shard: ``(module, batch, divisor) -> loss`` of a data rank: its summed token loss over ``N / dp``.
        rows: ``(batch, rows) -> the batch's rows``.
        plan: ``module -> {pattern: style}``, its tensor plan.
    """

    whole: Callable[[nn.Module, Any], Tensor]
    terms: Callable[[nn.Module, Any], Tensor]
    count: Callable[[Any], Tensor]
    shard: Callable[[nn.Module, Any, Tensor], Tensor]
    rows: Callable[[Any, slice], Any]
    plan: Callable[[nn.Module], dict[str, Any]]


def _hf_terms(module: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    from lightning_parallel.adapters.hf.model import causal_lm_loss_terms

    logits = module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return causal_lm_loss_terms(logits, batch["labels"])[0]


def _hf_plan(module: nn.Module) -> dict[str, Any]:
    from lightning_parallel.adapters.hf.tensor import hf_tensor_plan

    return hf_tensor_plan("model", module.model)[1]


def _gpt_whole(module: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    from examples.nlp.model import token_mean

    total, count = module.pipeline_loss_terms(module(batch[0]), batch[1])
    return token_mean(total, count, lambda t: t)  # global_token_mean on one rank


#: A Hugging Face causal LM held by the recipe (``module.model``), batches of ``input_ids``/``attention_mask``/
#: ``labels``.
HF = Objective(
    whole=lambda module, batch: module.model(**batch).loss, terms=_hf_terms,
    count=lambda batch: (batch["labels"][:, 1:] != -100).sum().to(torch.float32),
    shard=lambda module, batch, divisor: module.model(**batch, num_items_in_batch=divisor).loss,  # transformers' sum
    rows=lambda batch, rows: {key: value[rows] for key, value in batch.items()}, plan=_hf_plan)
#: The GPT recipe (``examples/nlp/model.py``), batches of ``(inputs, targets)``.
GPT = Objective(
    whole=_gpt_whole, terms=lambda module, batch: module.pipeline_loss_terms(module(batch[0]), batch[1])[0],
    count=lambda batch: (batch[1] != -100).sum().to(torch.float32),
    shard=lambda module, batch, divisor: module.pipeline_loss_terms(module(batch[0]), batch[1])[0] / divisor,
    rows=lambda batch, rows: (batch[0][rows], batch[1][rows]), plan=lambda module: module.tensor_parallel_plan())


def _column_split(linear: nn.Linear) -> None:
    def forward(x: Tensor) -> Tensor:
        weight, bias, half = linear.weight, linear.bias, linear.weight.shape[0] // 2
        parts = [nn.functional.linear(x, weight[rows], None if bias is None else bias[rows])
                 for rows in (slice(0, half), slice(half, None))]
        return torch.cat(parts, dim=-1)

    linear.forward = forward


def _row_split(linear: nn.Linear) -> None:
    def forward(x: Tensor) -> Tensor:
        weight, bias, half = linear.weight, linear.bias, linear.weight.shape[1] // 2
        out = nn.functional.linear(x[..., :half], weight[:, :half]) + nn.functional.linear(x[..., half:],
                                                                                           weight[:, half:])
        return out if bias is None else out + bias

    linear.forward = forward


def split_like_tensor_parallel(module: nn.Module, plan: dict[str, Any]) -> list[str]:
    """Make the Linear layers ``plan`` splits compute as two shards (see the module docstring).

    Args:
        module: the LightningModule.
        plan: its tensor plan, ``{pattern: style name}`` keyed by names inside ``module``.

    Returns:
        The names of the layers changed.
    """
    changed = []
    for name, sub in module.named_modules():
        style = next((value for pattern, value in plan.items() if fnmatch(name, pattern)), None)
        if not isinstance(sub, nn.Linear) or not isinstance(style, str):
            continue
        if style.startswith("colwise") and sub.weight.shape[0] % 2 == 0:
            _column_split(sub)
        elif style.startswith("rowwise") and sub.weight.shape[1] % 2 == 0:
            _row_split(sub)
        else:
            continue
        changed.append(name)
    return changed


def _shard_gradients(module: nn.Module, shard: Any, divisor: Tensor, how: Arithmetic, objective: Objective,
                     size: int) -> tuple[list[Optional[Tensor]], float]:
    """One data shard's gradients (its micro-batches accumulated) and loss, as the layout computes them on one
    rank."""
    module.zero_grad(set_to_none=True)
    if how.microbatches == 1:
        loss = objective.shard(module, shard, divisor)
        loss.backward()
        value = float(loss.detach())
    else:
        step, value = size // how.microbatches, 0.0
        for start in range(0, size, step):
            loss_sum = objective.terms(module, objective.rows(shard, slice(start, start + step)))
            loss = loss_sum * (1.0 / divisor)  # the runner's loss_sum * (loss_scale / divisor)
            loss.backward()
            value += float(loss.detach())
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()], value


def step_gradients(module: nn.Module, batch: Any, size: int, how: Arithmetic, objective: Objective) -> float:
    """Set every parameter's gradient as the layout would before its optimizer step; returns the step's loss as
    the layout computes it (the mean of its data shards' losses)."""
    if how.data_shards == 1 and how.microbatches == 1:  # whole, or tensor splits alone: the model's own mean
        module.zero_grad(set_to_none=True)
        loss = objective.whole(module, batch)
        loss.backward()
        return float(loss.detach())
    divisor = objective.count(batch) / how.data_shards
    # Data rank r serves rows r, r + dp, ... of the global batch (the loader's distributed sampler, not shuffled).
    part = size // how.data_shards
    shards = [_shard_gradients(module, objective.rows(batch, slice(r, None, how.data_shards)), divisor, how,
                               objective, part) for r in range(how.data_shards)]
    for index, param in enumerate(module.parameters()):
        grads = [grads[index] for grads, _ in shards if grads[index] is not None]
        param.grad = None if not grads else (grads[0] if len(grads) == 1 else sum(grads) / len(grads))
    return sum(value for _, value in shards) / len(shards)


def train_in_order(module: nn.Module, batches: Iterable[tuple[Any, int]], how: Arithmetic, objective: Objective,
                   record: Callable[[int], bool] = lambda step: True) -> dict[str, Any]:
    """Train ``module`` (built, seeded) on one process in the order of ``how``.

    Args:
        module: the LightningModule, built with its initial values.
        batches: ``(global batch, its size)`` per optimizer step.
        how: the layout's arithmetic.
        objective: how the model turns a batch into a loss (:data:`HF`, :data:`GPT`).
        record: which steps (from 1) to record the parameters after.

    Returns:
        ``{"step_parameters": {step: {name: tensor}}, "losses": [...], "split": [names]}``.
    """
    module.train()
    split = split_like_tensor_parallel(module, objective.plan(module)) if how.tensor else []
    configured = module.configure_optimizers()
    optimizer = configured["optimizer"] if isinstance(configured, dict) else configured
    recorded, losses = {}, []
    for step, (batch, size) in enumerate(batches, start=1):
        losses.append(step_gradients(module, batch, size, how, objective))
        optimizer.step()
        if record(step):
            recorded[step] = {name: p.detach().clone() for name, p in module.named_parameters()}
    return {"step_parameters": recorded, "losses": losses, "split": split}


def train_steps(model_type: str, mode: str, how: Arithmetic, steps: Optional[int] = None) -> dict[str, Any]:
    """A coverage-matrix family trained on one process in the order of ``how`` with the optimizer ``mode``, on the
    matrix's batches; ``step_parameters`` as a list by step (:func:`train_in_order`)."""
    from benchmarks.hf_coverage import cells
    from benchmarks.hf_coverage.optimizers import optimizer

    torch.manual_seed(0)
    module = cells.TinyFamily(model_type, mode).build()
    steps = steps or optimizer(mode).steps
    samples = cells.padded_batches(steps)
    size = cells.GLOBAL_BATCH
    batches = ({key: torch.stack([s[key] for s in samples[i * size:(i + 1) * size]]) for key in samples[0]}
               for i in range(steps))
    result = train_in_order(module, ((batch, size) for batch in batches), how, HF)
    result["step_parameters"] = [result["step_parameters"][step] for step in sorted(result["step_parameters"])]
    return result
