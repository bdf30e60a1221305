"""The data axis on FSDP2: every ZeRO stage, HSDP, and replicated data parallelism beside other axes.

``zero_stage`` 2/3 shard over the data axis (``fully_shard`` on a 1-D mesh), or under HSDP
shard within ``data_shard`` ranks and all-reduce across ``data_replicate`` groups (a 2-D
mesh). Replicated data parallelism (``zero_stage=0``) is the same machinery on a
``(data_parallel, 1)`` mesh: HSDP with shard groups of one rank, parameters never
resharded -- torchtitan's way of running DDP beside tensor and pipeline parallelism.

Note:
    Why FSDP2 and not DDP for ``zero_stage=0`` beside tensor or pipeline parallelism (alone, or with
    context parallelism only, the axis is DDP: :mod:`.replicated`): torch's ``DistributedDataParallel`` does not
    take tensor-parallel DTensor parameters without private hooks, its composable form
    (``replicate``) lives in a private module, and ``PipelineStage`` drives a DDP stage through DDP's private
    reducer; ``fully_shard`` is public, composes with TP's DTensors and with ``torch.distributed.pipelining``.
    The gradient of each FSDP2 unit (a bucket of consecutive layers, see ``bucket_bytes``, then the root) is
    all-reduced from
    its post-backward hook, i.e. during backward -- the overlap DDP's buckets give. Under
    pipelining torch's ``PipelineStage`` skips the sync of every micro-batch and reduces a
    stage once its last backward is done, while other stages still compute. An average is a
    sum divided by the group size, so the result is exact (1e-8 here). The price: parameters
    are DTensors on the data mesh, so a torch optimizer's step pays DTensor dispatch (see
    ``benchmarks/data_axis_comm.py``); the strategy steps element-wise optimizers on the local
    tensors instead (:mod:`.local_step`). What FSDP2 lacks is DDP's communication hooks: bf16
    compression is its ``MixedPrecisionPolicy.reduce_dtype``; PowerSGD has no FSDP2 form.

Note:
    Offload (``offload="params"``, ZeRO 2/3) is FSDP2's one public policy, ``CPUOffloadPolicy``:
    each sharded parameter lives in host memory and is copied to the device for its all-gather,
    its reduced gradient is copied back, and the optimizer steps on the CPU with its state there.
    FSDP2 has no policy that offloads the optimizer state alone (``OffloadPolicy`` is "none",
    ``CPUOffloadPolicy`` its only subclass), so ``offload="optimizer"`` is refused by
    :class:`~lightning_parallel.parallel.options.ParallelOptions` rather than run as something else.
    On a CPU mesh the device memory is the host memory: the policy is applied (its code path runs:
    copies to the mesh device, gradients to the CPU) but moves nothing, and without page pinning,
    which needs an accelerator (``fully_shard`` raises "Cannot access accelerator device when none
    is available" for the default ``pin_memory=True`` on a CPU-only build).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional

from torch import nn

from lightning_parallel.layout import DATA_AXES, DATA_CONTEXT, DATA_PARALLEL, ParallelLayout
from lightning_parallel.layout.meshes import data_mesh_shape

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def has_parameters(module: nn.Module) -> bool:
    """Whether ``module`` holds at least one parameter (a layer of another stage holds none)."""
    return any(True for _ in module.parameters())


def uses_data_axis(layout: ParallelLayout, zero_stage: int) -> bool:
    """Whether FSDP2 wraps the model: always under ZeRO 2/3, with a data (or context) axis under ``zero_stage=0``."""
    return bool(zero_stage) or layout.data_context > 1


def data_axis_mesh(
    layout: ParallelLayout, zero_stage: int, mesh: DeviceMesh, data_mesh: Optional[DeviceMesh]
) -> DeviceMesh:
    """The mesh ``fully_shard`` takes: ``data_mesh``'s 2-D view when one is needed, else the 1-D data axis.

    Args:
        layout: the resolved layout.
        zero_stage: the run's ZeRO stage.
        mesh: the 3-D run mesh.
        data_mesh: the run mesh with its data axis unflattened into ``(data_replicate, data_shard)``
            of :func:`data_mesh_shape` (``lightning_parallel._compat.unflatten_mesh_dim``), or None.

    Raises:
        ValueError: a 2-D data mesh is needed and ``data_mesh`` is missing or has another shape.
    """
    shape = data_mesh_shape(layout, zero_stage)
    if shape is None and layout.context_parallel_enabled:
        if data_mesh is None or DATA_CONTEXT not in (data_mesh.mesh_dim_names or ()):
            raise ValueError(f"{layout.describe()} reduces gradients over data x context: pass the data_mesh of "
                             f"RunMeshes.build(layout, device_type, {zero_stage}) (lightning_parallel.layout.meshes).")
        return data_mesh[DATA_CONTEXT]
    if shape is None:
        return mesh[DATA_PARALLEL]
    found = None if data_mesh is None else tuple(data_mesh[name].size() for name in DATA_AXES)
    if found != shape:
        raise ValueError(
            f"zero_stage={zero_stage} on {layout.describe()} reduces gradients over a {shape[0]} x {shape[1]} "
            f"(data_replicate, data_shard) mesh, but data_mesh is {found}: pass the data_mesh of "
            f"RunMeshes.build(layout, device_type, {zero_stage}) (lightning_parallel.layout.meshes)."
        )
    return data_mesh[DATA_AXES]


def shard_data_axis(
    layers: Sequence[nn.Module],
    roots: Sequence[nn.Module],
    dp_mesh: DeviceMesh,
    zero_stage: int,
    mp_policy: Optional[Any] = None,
    bucket_bytes: int = 0,
    prefetch: Optional[int] = None,
    offload: str = "none",
    ignored: Optional[set] = None,
) -> None:
    """Apply FSDP2 ``fully_shard`` per layer (or bucket of layers), then to each root, over the data mesh.

    Args:
        layers: the model's pipeline layers (each its own FSDP unit: parameters gathered, gradients reduced
            during backward, one layer at a time); layers of other stages hold no parameters and are skipped.
        roots: the modules that take the remaining parameters: the whole model, or under pipelining each local
            stage module (so ``PipelineStage`` controls gradient synchronisation per micro-batch).
        dp_mesh: the 1-D data mesh or the 2-D ``(data_replicate, data_shard)`` one (HSDP; zero 0: shards of 1).
        zero_stage: 0 (replicated), 2 (kept gathered after forward) or 3 (resharded after forward).
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` (None: FSDP2's default, full precision).
        bucket_bytes: consecutive layers join one FSDP2 unit until their parameters reach this many bytes
            (as DDP fills its buckets); 0: one unit per layer.
        prefetch: each layer prefetches the all-gathers of this many following layers of its
            root in forward, and of as many preceding ones in backward (see :func:`set_prefetch`);
            None: FSDP2's default. Needs one unit per layer (``bucket_bytes=0``, ZeRO 2/3's default).
        offload: ``"none"`` or ``"params"`` (:func:`offload_policy`; ``ParallelOptions.offload``).
        ignored: parameters FSDP2 leaves alone (experts: reduced over the expert-data group instead).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": dp_mesh, "reshard_after_forward": zero_stage == 3,
              "mp_policy": mp_policy if mp_policy is not None else MixedPrecisionPolicy(),
              "offload_policy": offload_policy(offload, dp_mesh.device_type)}
    if ignored:
        kwargs["ignored_params"] = set(ignored)
    units = _layers_by_root([layer for layer in layers if has_parameters(layer)], roots)
    for group in units:
        # A bucket never spans two roots (a rank's interleaved stages): a shared unit fails their lazy init.
        for bucket in layer_buckets(group, bucket_bytes):
            # A list is one unit: its modules may run apart in the iteration (torch >= 2.13).
            fully_shard(bucket if len(bucket) > 1 else bucket[0], **kwargs)
    for root in roots:
        fully_shard(root, **kwargs)
    if prefetch is not None:
        if bucket_bytes:
            raise ValueError(f"prefetch={prefetch} counts layers, but bucket_bytes={bucket_bytes} groups layers into "
                             "one unit: pass bucket_bytes=0.")
        for group in units:  # per root, i.e. per pipeline stage: a rank's next stage runs after other micro-batches
            set_prefetch(group, prefetch)


def offload_policy(offload: str, device_type: str) -> Any:
    """FSDP2's offload policy for ``offload``: ``OffloadPolicy()`` (none) or ``CPUOffloadPolicy`` (``"params"``).

    ``CPUOffloadPolicy`` keeps the sharded parameters, their gradients and (the optimizer stepping where
    the parameters are) the optimizer state in host memory. Host memory is pinned on an accelerator,
    for asynchronous copies; on a CPU mesh nothing moves and pinning (which needs an accelerator) is off.

    Args:
        offload: ``"none"`` or ``"params"`` (``ParallelOptions.offload``, validated there).
        device_type: the data mesh's device type (``"cuda"``, ``"cpu"``, ...).

    Raises:
        ValueError: any other ``offload`` (``"optimizer"`` has no FSDP2 form: use ``"params"``).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if offload == "none":
        return OffloadPolicy()
    if offload == "params":
        return CPUOffloadPolicy(pin_memory=device_type != "cpu")
    raise ValueError(f"offload={offload!r} has no FSDP2 policy: use 'none' or 'params' (parameters, gradients and "
                     "optimizer state in host memory; see ParallelOptions).")


def set_prefetch(units: Sequence[nn.Module], depth: int) -> None:
    """Make each FSDP2 unit prefetch the all-gathers of the next ``depth`` units in forward and of the previous
    ``depth`` in backward (FSDP2's public ``set_modules_to_forward_prefetch``/``set_modules_to_backward_prefetch``).

    FSDP2's default issues one layer's all-gather ahead (forward: when the layer before it
    runs; backward: by the reverse forward order); ``depth >= 2`` keeps more all-gathers in
    flight, for more overlap on slow links at the memory of ``depth`` gathered layers. Under
    ``zero_stage=2`` parameters stay gathered from forward to backward, so only the forward
    prefetch matters there.

    Args:
        units: FSDP2 modules in forward execution order (the layers of one root).
        depth: how many units ahead to prefetch (>= 1).
    """
    for i, unit in enumerate(units):
        ahead, behind = list(units[i + 1:i + 1 + depth]), list(reversed(units[max(0, i - depth):i]))
        if ahead:
            unit.set_modules_to_forward_prefetch(ahead)
        if behind:
            unit.set_modules_to_backward_prefetch(behind)  # backward runs the layers in reverse: nearest first


def _layers_by_root(layers: Sequence[nn.Module], roots: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """Consecutive runs of ``layers`` that sit under the same root (each pipeline stage is a root)."""
    owner = {id(sub): index for index, root in enumerate(roots) for sub in root.modules()}
    runs: list[list[nn.Module]] = []
    previous = None
    for layer in layers:
        root = owner.get(id(layer))
        if not runs or root != previous:
            runs.append([])
        runs[-1].append(layer)
        previous = root
    return runs


def layer_buckets(layers: Sequence[nn.Module], bucket_bytes: int) -> list[list[nn.Module]]:
    """Consecutive ``layers`` grouped until each group's parameters reach ``bucket_bytes`` (0: one per group)."""
    buckets: list[list[nn.Module]] = []
    size = bucket_bytes  # start a new bucket at the first layer
    for layer in layers:
        if size >= bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(layer)
        size += sum(p.numel() * p.element_size() for p in layer.parameters())
    return buckets


@contextmanager
def deferred_gradient_sync(module: nn.Module, zero_stage: int, hsdp: bool) -> Iterator[None]:
    """Skip the data-axis reduction of the backwards inside (gradient accumulation micro-steps).

    ``zero_stage=0`` skips all communication: gradients accumulate unreduced, as under DDP's
    ``no_sync``. HSDP under ZeRO 2/3 skips only the all-reduce across replica groups: the
    reduce-scatter within a shard group still runs, so gradients stay sharded in memory.
    Flat ZeRO 2/3 keeps reducing every micro-step for the same reason (sharded gradients
    are the point of ZeRO-2). On exit every FSDP2 module syncs again.

    Args:
        module: the model holding FSDP2 modules (no-op without them), or its ``DistributedDataParallel`` wrapper
            (the plain data axis, :mod:`.replicated`: its ``no_sync``).
        zero_stage: the run's ZeRO stage.
        hsdp: whether the data axis is split into replica and shard groups.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        with module.no_sync():
            yield
        return

    units = [m for m in module.modules() if isinstance(m, FSDPModule)] if zero_stage == 0 or hsdp else []
    for unit in units:
        if zero_stage == 0:
            unit.set_requires_gradient_sync(False, recurse=False)
        else:
            unit.set_requires_all_reduce(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_requires_gradient_sync(True, recurse=False)


def own_class(module: nn.Module) -> type:
    """``module``'s class as the user built it: FSDP2 gives a module it shards a class of its own (``FSDP<Name>``,
    a subclass of ``FSDPModule`` and the original), which names nothing a reader of a checkpoint can rebuild.

    Args:
        module: any module, sharded by ``fully_shard`` or not.
    """
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
