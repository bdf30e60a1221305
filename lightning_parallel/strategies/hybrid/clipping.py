"""Lightning's ``gradient_clip_val`` with the global norm of a model split over pipeline and tensor ranks.

Note:
    Lightning clips through the precision plugin (``LightningModule.clip_gradients`` calls
    ``trainer.precision_plugin.clip_gradients``), whose ``clip_grad_by_norm`` runs torch's
    ``clip_grad_norm_`` on this rank's parameters: the wrong norm under pipelining, and an
    error for a mix of DTensor and plain parameters. :class:`GlobalNormClipping` wraps
    whatever plugin the Trainer chose (32-true, bf16-mixed, ...) and delegates everything
    to it except the two clipping methods, so the plugin instance itself is never changed
    and each precision keeps its own behaviour.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_parallel.parallel import grad_norm_clipping as gradients

_OWN = frozenset({"clip_grad_by_norm", "clip_grad_by_value", "clip_gradients", "check_norm_once"})


def _delegate(name: str) -> Any:
    def method(self: GlobalNormClipping, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"The wrapped plugin's ``{name}``."
    return method


class GlobalNormClipping(Precision):
    """A precision plugin that is ``inner`` in every respect but clipping, which sees the whole model.

    Args:
        inner: the precision plugin the Trainer chose.
        pipeline_group: the pipeline process group whose stages hold the rest of the model
            (None when not pipelined); tensor-parallel shards are summed through DTensor.
    """

    def __init__(self, inner: Precision, pipeline_group: Optional[dist.ProcessGroup]) -> None:
        self.inner = inner
        self.pipeline_group = pipeline_group
        self._norm_checks: list[Callable[[Tensor], None]] = []
        # The global norm the last clipping computed (None before any): the RunScalars callback logs it, so
        # TensorBoard shows the norm without a second collective.
        self.last_norm: Optional[Tensor] = None

    def check_norm_once(self, check: Callable[[Tensor], None]) -> None:
        """Hand the next clipping's global gradient norm to ``check`` before the gradients are clipped.

        :class:`~lightning_parallel.callbacks.NonFiniteGuard` uses it: a non-finite gradient on any rank makes the
        global norm non-finite on every rank, so the guard needs no collective of its own, and it sees the
        gradients as the clipping does (after every ``on_before_optimizer_step`` hook).

        Args:
            check: called once with the norm; it may raise, or drop the gradients (``param.grad = None``).
        """
        self._norm_checks.append(check)

    @property
    def precision(self) -> Any:  # type: ignore[override]
        return self.inner.precision

    def __getattr__(self, name: str) -> Any:
        # Attributes the base class does not define (``scaler``, ``device``, ...) are the inner plugin's.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        total = gradients.total_grad_norm(params, 2.0, pipeline_group=self.pipeline_group)
        self.last_norm = total.detach()
        checks, self._norm_checks = self._norm_checks, []
        for check in checks:
            check(total)
        gradients.clip_grad_norm_(params, clip_val, 2.0, pipeline_group=self.pipeline_group, total=total)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        from torch.distributed.tensor import DTensor

        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clamp_(-clip_val, clip_val)


# Every other method of Lightning's Precision API goes to the wrapped plugin, so its own
# optimizer step, contexts, conversions and state are the ones that run.
for _name in dir(Precision):
    if not _name.startswith("__") and _name not in _OWN and callable(getattr(Precision, _name)):
        setattr(GlobalNormClipping, _name, _delegate(_name))
