"""DDP's communication hooks (fp16 / bf16 compression, PowerSGD) for data-parallel-only runs.

``conf/strategy/ddp.yaml`` builds its strategy through :func:`ddp_strategy`: ``comm_hook: none``
gives Lightning's own ``DDPStrategy`` unchanged; the other names register one of torch's
public hooks (``torch.distributed.algorithms.ddp_comm_hooks``) on the
``DistributedDataParallel`` module Lightning builds.

Note:
    Why a subclass and not ``DDPStrategy(ddp_comm_hook=...)``: Lightning 2.6 registers the hook
    only when the root device is CUDA (its private ``_register_ddp_hooks``, a check from torch
    1.8's NCCL-only hooks) and silently ignores it on CPU. torch's hooks run on gloo as well
    (all-reduce of fp16 and bf16 tensors included), so :class:`CommHookDDPStrategy` registers the
    hook itself through DDP's public ``register_comm_hook`` on every device, and passes nothing to
    Lightning's own arguments (no second registration on CUDA).

    Why only here: the hybrid strategy reduces the data axis with FSDP2, which has no
    communication hooks (``parallel/data.py``); its ``comm_hook: bf16`` is FSDP2's
    ``reduce_dtype``, and ``fp16``/``powersgd`` there are refused with a pointer to this strategy.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning.pytorch.strategies import DDPStrategy

COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")

# PowerSGD's defaults here: rank 1 (the strongest compression), and exact all-reduce for the first
# 10 steps (torch needs >= 2 with error feedback and warm start; its own default is 1000).
POWERSGD_RANK = 1
POWERSGD_START_ITER = 10


class CommHookDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with a DDP communication hook registered on every device (CPU/gloo too).

    Args:
        comm_hook: a DDP communication hook ``hook(state, bucket) -> Future``, e.g.
            ``default_hooks.fp16_compress_hook`` or ``powerSGD_hook.powerSGD_hook``.
        comm_state: the hook's state (``PowerSGDState`` for PowerSGD; None: the default process group).
        **ddp_kwargs: ``DDPStrategy`` arguments (``timeout``, ``bucket_cap_mb``, ...), but not its
            own ``ddp_comm_hook``/``ddp_comm_state``/``ddp_comm_wrapper``.
    """

    def __init__(self, comm_hook: Callable, comm_state: Any = None, **ddp_kwargs: Any) -> None:
        taken = sorted({"ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"} & set(ddp_kwargs))
        if taken:
            raise ValueError(f"{taken} would register a second hook: pass the hook as comm_hook/comm_state only.")
        super().__init__(**ddp_kwargs)
        self.comm_hook = comm_hook
        self.comm_state = comm_state

    def configure_ddp(self) -> None:
        """Wrap the module in DDP (Lightning), then register the hook through DDP's public API."""
        super().configure_ddp()
        self.model.register_comm_hook(state=self.comm_state, hook=self.comm_hook)


def _positive_int(name: str, value: Any, minimum: int, why: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum} ({why}).")
    return value


def ddp_strategy(
    comm_hook: str = "none",
    powersgd_rank: Optional[int] = None,
    powersgd_start_iter: Optional[int] = None,
    **ddp_kwargs: Any,
) -> DDPStrategy:
    """Lightning's DDP strategy, with gradient compression chosen by name.

    Args:
        comm_hook: ``"none"`` (exact fp32 all-reduce: Lightning's ``DDPStrategy`` as it is),
            ``"fp16"`` or ``"bf16"`` (each bucket cast and all-reduced in half precision: half the
            bytes; fp16 keeps 10 mantissa bits but underflows below 6e-8 (gradients are divided by
            the world size first), bf16 keeps fp32's range with 7 bits), or ``"powersgd"`` (each
            gradient matrix all-reduced as a rank-``powersgd_rank`` factorisation with error feedback).
        powersgd_rank: PowerSGD's ``matrix_approximation_rank`` (default 1); ``comm_hook="powersgd"`` only.
        powersgd_start_iter: steps of exact all-reduce before PowerSGD starts (default 10, at least 2:
            DDP rebuilds its buckets after the first step); ``comm_hook="powersgd"`` only.
        **ddp_kwargs: further ``DDPStrategy`` arguments (``timeout``, ``bucket_cap_mb``, ...).

    Raises:
        ValueError: an unknown hook, a PowerSGD setting out of range, or one given without
            ``comm_hook="powersgd"``.
    """
    if comm_hook not in COMM_HOOKS:
        raise ValueError(f"Unknown comm_hook={comm_hook!r}: use one of {COMM_HOOKS}.")
    given = {n: v for n, v in (("powersgd_rank", powersgd_rank), ("powersgd_start_iter", powersgd_start_iter))
             if v is not None}
    if comm_hook != "powersgd":
        if given:
            settings = ", ".join(f"{n}={v}" for n, v in given.items())
            raise ValueError(f"{settings} configures PowerSGD, but comm_hook={comm_hook!r}: set comm_hook=powersgd, "
                             "or drop it.")
        if comm_hook == "none":
            return DDPStrategy(**ddp_kwargs)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.fp16_compress_hook if comm_hook == "fp16" else default_hooks.bf16_compress_hook
        return CommHookDDPStrategy(hook, None, **ddp_kwargs)

    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    rank = _positive_int("powersgd_rank", POWERSGD_RANK if powersgd_rank is None else powersgd_rank, 1,
                         "the rank of each gradient's low-rank approximation, e.g. 1, 2 or 4")
    start = _positive_int("powersgd_start_iter", POWERSGD_START_ITER if powersgd_start_iter is None
                          else powersgd_start_iter, 2,
                          "PowerSGD's error feedback and warm start need DDP's buckets, rebuilt after step 1")
    # process_group=None: the default group, i.e. every rank, which is DDP's data axis here.
    state = PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start)
    return CommHookDDPStrategy(powerSGD_hook, state, **ddp_kwargs)
