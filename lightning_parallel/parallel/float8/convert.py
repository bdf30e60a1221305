"""Step 1b of :func:`~lightning_parallel.parallel.compose.parallelize`: the chosen Linear layers become torchao's
``Float8Linear``, before tensor parallelism and FSDP2 (torchao's documented order).

* **Conversion** -- ``torchao.float8.convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name(recipe)``
  on the layers :mod:`.choice` picked, on this rank's share after the pipeline split (names never change, so the
  initialisation plan recorded on the unsplit model and every checkpoint key still apply). Off CUDA the config's
  ``emulate=True``: the FP8 values are the same, the matmul runs in fp32 instead of on FP8 tensor cores.
* **FSDP2** -- under tensorwise scaling with ZeRO 2/3 the weights are all-gathered in FP8
  (``enable_fsdp_float8_all_gather``: each shard cast with the scale of the whole weight, half the bytes of bf16), and
  after each optimizer step :func:`precompute_scales` computes every weight's scale in one all-reduce
  (``precompute_float8_dynamic_scale_for_fsdp``). torchao has no FP8 all-gather for rowwise scales: the weights are
  gathered in high precision and cast per row after the gather.
* **Tensor parallelism** -- under tensorwise scaling the plan's ``ColwiseParallel``/``RowwiseParallel`` of converted
  layers become torchao's ``Float8ColwiseParallel``/``Float8RowwiseParallel`` (same layouts): activations are cast
  to FP8 before they are redistributed, and gradients of the outputs on the way back. Rowwise keeps torch's styles
  (torchtitan does the same: torchao's FP8 styles assume one scale per tensor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_parallel.parallel.float8.choice import Float8Choice, choose_float8_layers

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

    from lightning_parallel.layout import ParallelLayout
    from lightning_parallel.parallel.options import ParallelOptions


@contextlib.contextmanager
def _quiet_torchao_import() -> Iterator[None]:
    """torchao logs a warning per CUDA kernel library it cannot load into a CPU build of torch; nothing here uses
    those kernels off CUDA, so the import stays quiet there (on CUDA a failed load is worth seeing)."""
    log = logging.getLogger("torchao")
    level = log.level
    if not torch.cuda.is_available():
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def uses_float8_all_gather(options: ParallelOptions, layout: ParallelLayout) -> bool:
    """Whether FSDP2 gathers the FP8 layers' weights in FP8: asked (``float8_all_gather=True``), or by default
    under tensorwise scaling where ZeRO 2/3 shards them over more than one rank."""
    if options.float8_all_gather is not None:
        return options.float8_all_gather
    return options.float8 == "tensorwise" and options.zero_stage in (2, 3) and layout.data_context > 1


def float8_choice(module: nn.Module, adapter: Any, options: ParallelOptions, layout: ParallelLayout,
                  plan: Mapping[str, ParallelStyle], device: torch.device) -> Float8Choice:
    """The FP8 decision for ``module`` (whole, before the split) under ``options`` and ``layout``.

    Args:
        module: the whole model.
        adapter: its model adapter.
        options: the run's options (``float8``, ``float8_all_gather``, ``zero_stage``).
        layout: the run's layout.
        plan: the resolved tensor plan (empty without tensor parallelism).
        device: this rank's device (FP8 tensor cores on CUDA, torchao's emulation elsewhere).
    """
    converted, kept = choose_float8_layers(module, adapter, layout.tensor_parallel, plan)
    return Float8Choice(options.float8, converted, kept, all_gather=uses_float8_all_gather(options, layout),
                        tensor_styles=options.float8 == "tensorwise" and layout.tensor_parallel_enabled,
                        emulated=device.type != "cuda")


def float8_config(choice: Float8Choice) -> Any:
    """torchao's ``Float8LinearConfig`` for ``choice``: the recipe, emulation off CUDA, FP8 all-gather where chosen."""
    with _quiet_torchao_import():
        from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(choice.recipe)
    return dataclasses.replace(config, emulate=choice.emulated, enable_fsdp_float8_all_gather=choice.all_gather)


def convert_chosen(module: nn.Module, choice: Float8Choice) -> list[str]:
    """Swap the chosen Linear layers this rank holds for ``Float8Linear`` in place; returns their names.

    Args:
        module: the model after the pipeline split (other stages' layers are parameter-free placeholders).
        choice: :func:`float8_choice` of the whole model.
    """
    with _quiet_torchao_import():
        from torchao.float8 import convert_to_float8_training

    chosen, swapped = set(choice.converted), []

    def wanted(layer: nn.Module, name: str) -> bool:
        if name in chosen and isinstance(layer, nn.Linear):
            swapped.append(name)
            return True
        return False

    convert_to_float8_training(module, module_filter_fn=wanted, config=float8_config(choice))
    return swapped


def float8_styles(plan: Mapping[str, ParallelStyle], converted: Iterable[str]) -> dict[str, ParallelStyle]:
    """The tensor plan with torch's column/row styles of converted layers replaced by torchao's FP8 styles.

    Args:
        plan: the resolved plan (``{name: ParallelStyle}``).
        converted: names of the layers :func:`convert_chosen` made ``Float8Linear`` (torchao's class is not public).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    converted, styles = set(converted), dict(plan)
    for name, style in plan.items():
        kind = type(style)
        if kind not in (ColwiseParallel, RowwiseParallel) or name not in converted:
            continue
        fp8 = Float8ColwiseParallel if kind is ColwiseParallel else Float8RowwiseParallel
        styles[name] = fp8(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                           use_local_output=style.use_local_output)
    return styles


def apply_float8(module: nn.Module, choice: Float8Choice, plan: Mapping[str, ParallelStyle]
                 ) -> dict[str, ParallelStyle]:
    """Step 1b: convert this rank's chosen layers; returns the tensor plan to apply (with FP8 styles where chosen).

    Args:
        module: the model after the pipeline split, before tensor parallelism and FSDP2.
        choice: :func:`float8_choice` of the whole model.
        plan: the resolved tensor plan.
    """
    converted = convert_chosen(module, choice)
    return float8_styles(plan, converted) if choice.tensor_styles else dict(plan)


@torch.no_grad()
def precompute_scales(module: nn.Module) -> None:
    """After an optimizer step under FP8 all-gather: every FP8 weight's scale in one all-reduce, for the next
    all-gathers (torchao's ``precompute_float8_dynamic_scale_for_fsdp``; without it each gather reduces its own).

    Args:
        module: the parallelised model.
    """
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(module)
