"""How a Lightning step enters DeepSpeed's engine under :class:`~lightning_parallel.strategies.deepspeed.strategy.
DeepSpeedDataParallelStrategy`: the step redirection and the precision plugin it hands Lightning instead of its own.

Note:
    Under ZeRO-3, Lightning's step redirection enters the LightningModule twice per step:
    the engine calls it with ``forward`` patched to ``training_step``, and
    ``training_step`` calls ``self(...)``. DeepSpeed starts a new step (``reset_step``)
    at every entry of its top module, so its parameter trace was cut after one module and
    discarded every step: parameters were gathered again for backward (2x the all-gather
    bytes) and the trace checks cost 8 broadcasts per step.
    :class:`ZeRO3ForwardRedirection` makes one redirected step one DeepSpeed step; the
    collectives then equal those of a raw ``deepspeed.initialize`` loop.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import DeepSpeedPrecision
from torch.nn import Module
from typing_extensions import override

from lightning_parallel._compat import DDPForwardRedirection, zero3_param_coordinator

__all__ = ["AutocastDeepSpeedPrecision", "ZeRO3ForwardRedirection"]


class ZeRO3ForwardRedirection(DDPForwardRedirection):
    """Lightning's step redirection, counted by ZeRO-3 as one step however often the module is entered.

    Lightning runs ``training_step`` (and the evaluation steps) through the engine by
    patching the LightningModule's ``forward``; the step then calls ``self(...)``, which
    enters the same top module again. DeepSpeed's start-of-forward hook on that module
    calls ``reset_step`` on every entry, so the second entry completes a one-module trace
    that the next submodule invalidates -- every step. While a step is redirected, only the
    first ``reset_step`` runs: the trace then covers the whole forward and backward, is
    recorded once and reused, as in a raw ``engine(batch)`` loop.
    """

    @override
    def __call__(self, wrapper_module: Module, original_module: Any, method_name: str,
                 *args: Any, **kwargs: Any) -> Any:
        coordinator = zero3_param_coordinator(wrapper_module)
        if coordinator is None or "reset_step" in vars(coordinator):
            return super().__call__(wrapper_module, original_module, method_name, *args, **kwargs)
        reset_step = coordinator.reset_step
        entries = 0

        def reset_on_first_entry() -> None:
            nonlocal entries
            entries += 1
            if entries == 1:
                reset_step()

        # An instance attribute shadows the method for this call only; deleted below.
        coordinator.reset_step = reset_on_first_entry
        try:
            return super().__call__(wrapper_module, original_module, method_name, *args, **kwargs)
        finally:
            del coordinator.reset_step


class AutocastDeepSpeedPrecision(DeepSpeedPrecision):
    """Lightning's DeepSpeed precision for ``bf16-mixed`` (DeepSpeed's ``torch_autocast``), inputs left as they come.

    Lightning's plugin casts every floating-point batch tensor to bf16 under ``bf16-mixed``,
    targets included, which no other strategy does under autocast (a loss against
    bf16-rounded targets differs from the first step on). Autocast casts what each op needs.
    """

    @override
    def convert_input(self, data: Any) -> Any:
        return data
