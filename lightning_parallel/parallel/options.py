"""One frozen, validated set of options for the data x pipeline x tensor strategies.

The strategies, their presets, the start-up table and the Hydra configs all read a
:class:`ParallelOptions`; it is validated once, at construction, so every later reader can
trust it. The checks themselves are :mod:`.option_checks` (one function per group of options);
checks that need the module or the world size (layers vs. stages, sizes that divide) live in
:mod:`lightning_parallel.parallel.compose` and :mod:`lightning_parallel.layout`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Optional, Union

from lightning_parallel.layout import ParallelLayout, Size, check_size
from lightning_parallel.parallel import option_checks as checks
from lightning_parallel.parallel.activation_checkpoint import Choice, check_choice
from lightning_parallel.parallel.compile import Compile, check_compile, compile_backend
from lightning_parallel.parallel.float8.checks import check_float8_options
from lightning_parallel.parallel.option_checks import CONTEXT_METHODS, OFFLOAD_MODES, ZERO_STAGES, check_dtype_option
from lightning_parallel.parallel.pipeline.schedules import validate_schedule

# How the hybrid strategy's arguments are spelled in layout errors.
SIZE_NAMES = {"data_parallel": "data_parallel_size", "pipeline_parallel": "pipeline_parallel_size",
              "tensor_parallel": "tensor_parallel_size", "context_parallel": "context_parallel_size",
              "expert_parallel": "expert_parallel_size"}

__all__ = [
    "CONTEXT_METHODS", "DEFAULT_TIMEOUT", "OFFLOAD_DESCRIPTIONS", "OFFLOAD_MODES", "ParallelOptions",
    "SIZE_NAMES", "ZERO_DESCRIPTIONS", "ZERO_STAGES", "as_timeout", "option_names", "options_from", "plain",
]

# The one default collective timeout of every strategy in the suite: long enough for a slow
# checkpoint write, short enough that a dead rank fails the job within the hour.
DEFAULT_TIMEOUT = timedelta(minutes=30)

# What the data axis does at each ZeRO stage (start-up table, docs).
ZERO_DESCRIPTIONS = {
    0: "replicated, gradients all-reduced in buckets of layers during backward (FSDP2, shard groups of 1)",
    2: "FSDP2: gradients + optimizer state sharded",
    3: "FSDP2: parameters, gradients + optimizer state sharded",
}

# What ``offload`` does (start-up table, docs).
OFFLOAD_DESCRIPTIONS = {
    "none": "none: parameters, gradients and optimizer state on the device",
    "params": "FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer state in host memory, optimizer "
              "step on the CPU (no-op where the device is the CPU)",
}


def plain(value: Any) -> Any:
    """Hydra passes DictConfig/ListConfig; the machinery wants plain containers."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def as_timeout(value: Union[None, int, float, timedelta]) -> timedelta:
    """A collective timeout from a ``timedelta``, seconds, or ``None`` (:data:`DEFAULT_TIMEOUT`).

    Raises:
        ValueError: not a positive duration.
    """
    if value is None:
        return DEFAULT_TIMEOUT
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta) or value.total_seconds() <= 0:
        raise ValueError(f"timeout={value!r} must be a positive timedelta or a number of seconds (e.g. 1800).")
    return value


@dataclass(frozen=True)
class ParallelOptions:
    """Everything a data x pipeline x tensor run is asked to do, validated once.

    The one description of the options of :class:`~lightning_parallel.strategies.HybridParallelStrategy`
    and its presets (``PipelineParallelStrategy``, ``TensorParallelStrategy``): they take these fields as
    keywords, or one ``ParallelOptions`` as ``options=``; ``conf/strategy/*.yaml`` sets them by the same
    names. Each field is also an attribute of ``strategy.options``.

    Args:
        data_parallel_size: replicas of the model; ``"auto"``: what the other sizes leave of the world.
        pipeline_parallel_size: pipeline ranks (consecutive groups of layers); ``"auto"``: the whole world.
        tensor_parallel_size: ranks sharing each layer's matrices; ``"auto"``: the whole world.
        zero_stage: what the data axis shards: 0 (nothing: replicated, gradient all-reduce), 2 (FSDP2:
            gradients and optimizer state) or 3 (parameters too). ZeRO-1 is DeepSpeed's
            (``DeepSpeedDataParallelStrategy(zero_stage=1)``, ``strategy=deepspeed_zero1``).
        microbatches: micro-batches per batch for the pipeline schedule (must divide the per-rank batch).
        schedule: a pipeline schedule name: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``,
            ``interleaved_zero_bubble``, ``zbv``, ``dualpipev`` (see ``parallel.pipeline.schedules``).
        partition: where the pipeline cuts the layers: ``"uniform"`` (equal counts), ``"parameters"``
            (equal parameter counts), ``"time"`` (equal measured forward+backward time) or a list of cut points.
        stages_per_rank: pipeline stages per rank (2+ for the interleaved and zero-bubble schedules).
        sequence_parallel: shard norm/dropout activations along the sequence over the tensor group.
        loss_parallel: vocabulary-parallel cross-entropy on a vocabulary-sharded LM head.
        plan: extra or overriding tensor-parallel plan entries (submodule glob -> style name; None removes
            an entry of the module's ``tensor_parallel_plan()``).
        save_distributed_checkpoint: write a sharded DCP folder (True; loads under any layout) or one
            consolidated file (False; not under pipeline parallelism).
        async_save: write the sharded folder in the background (DCP's ``async_save``): the step waits only while
            the state is copied to CPU memory; one save in flight, the next save and the run's end wait for it; the
            folder appears complete or not at all (:mod:`lightning_parallel.checkpoints.dcp.async_writer`).
        timeout: collective timeout (``timedelta`` or seconds), so a dead rank fails the run instead of
            hanging it; None: :data:`DEFAULT_TIMEOUT`.
        activation_checkpointing: ``"none"``, ``"full"`` (every layer recomputes its forward in backward),
            ``"selective"`` (keeps matmul and attention outputs) or a list of submodule globs
            (see :mod:`lightning_parallel.parallel.activation_checkpoint`).
        compile: ``torch.compile`` each of this rank's layers (:mod:`lightning_parallel.parallel.compile`): ``True``
            (inductor), a backend name (``"aot_eager"``, ...), or ``False`` (eager, the default).
        param_dtype: FSDP2's all-gathered (computing) parameter dtype under ``zero_stage`` 2/3,
            ``"float32"`` or ``"bfloat16"``; None: bf16 under ``bf16-mixed`` without tensor parallelism,
            else the parameters' own (see :mod:`lightning_parallel.parallel.precision`).
        reduce_dtype: the data-axis gradient reduction's dtype (FSDP2's reduce-scatter, or its all-reduce
            under ``zero_stage=0``): ``"float32"`` (default) or ``"bfloat16"``.
        data_replicate_size: HSDP (``zero_stage`` 2/3): groups of data ranks that all-reduce across each
            other; with ``data_shard_size`` (give either or both) the product is ``data_parallel_size``.
            None for both: shard over the whole data axis (see :mod:`lightning_parallel.parallel.data`).
        data_shard_size: HSDP (``zero_stage`` 2/3): data ranks sharding one replica (e.g. one node).
        comm_hook: DDP's gradient compression by its Lightning name: ``"none"`` or ``"bf16"`` (FSDP2's form
            of it: ``reduce_dtype="bfloat16"``); ``"fp16"`` and ``"powersgd"`` have no FSDP2 form and are
            refused (data-parallel-only runs get them from ``strategy=ddp``,
            :mod:`lightning_parallel.strategies.ddp_comm`).
        bucket_size_mb: ``zero_stage=0``: consecutive layers share one gradient all-reduce until their
            parameters reach this size (DDP's ``bucket_cap_mb``; None: 25, 0: one per layer under FSDP2, one per
            parameter where the axis is DDP, ``parallel/replicated.py``). ``zero_stage=2``: layers join one FSDP2
            unit up to this size, fewer collectives at no parameter memory (ZeRO 2 holds them gathered from forward
            to backward anyway); None: one per layer.
        find_unused_parameters: where the data axis is DDP (``zero_stage=0`` alone, :mod:`.replicated`), let a step
            leave parameters without a gradient (DDP's option of that name: a graph walk per step; without it DDP
            fails the next step). FSDP2's axis needs no such option.
        fsdp_prefetch: ``zero_stage`` 2/3: each layer's FSDP2 unit issues the all-gathers of the next
            ``fsdp_prefetch`` layers of its stage ahead of time (and of the previous ones in backward);
            None: FSDP2's default (the next layer, issued when its own forward or backward starts).
        offload: ``zero_stage`` 2/3: ``"none"`` or ``"params"`` (FSDP2's ``CPUOffloadPolicy``: the sharded
            parameters, their gradients and the optimizer state live in host memory, each layer's shard is copied
            to the device for its all-gather and the optimizer step runs on the CPU; on a CPU device nothing
            moves). ``"optimizer"`` is refused: FSDP2 has no optimizer-only offload (see
            :mod:`lightning_parallel.parallel.data`).
        context_parallel_size: ranks that split every sequence of a data replica (context parallelism,
            :mod:`lightning_parallel.parallel.context`); 1: off; ``"auto"`` (the ``context_parallel`` preset): what
            the other sizes, then explicit, leave of the world.
        context_parallel_method: how attention sees the other ranks' keys: ``"ring"`` (key/value blocks
            travel around the context group; any head count) or ``"ulysses"`` (all-to-all from sequence to
            head shards around an unchanged attention kernel; heads per tensor rank divisible by the size).
        expert_parallel_size: ranks sharing each mixture-of-experts layer's experts (``E / size`` each), borrowed
            from the data x context ranks (must divide them); tokens travel to their experts by all-to-all
            (:mod:`lightning_parallel.parallel.experts`); 1: every rank holds every expert.
        expert_data_shard: also shard each rank's experts over the ranks that hold the same experts (the
            expert-data group; torchtitan's ``efsdp``): FSDP2 cuts their second dimension, gathers them for the
            expert matmuls and reduce-scatters their gradients, so expert bytes per rank fall with the data size.
            False: the expert-data ranks each keep their experts whole and all-reduce the gradients.
        float8: FP8 training through torchao (:mod:`lightning_parallel.parallel.float8`, docs/float8.md): ``None``
            (off), ``"tensorwise"`` or ``"rowwise"`` scaling; Linear layers become ``Float8Linear`` before tensor
            parallelism and FSDP2, except those the model's adapter keeps in high precision (head, router).
        float8_all_gather: FSDP2 all-gathers FP8 weights (tensorwise only): None: on under ZeRO 2/3, True:
            required, False: gathered in high precision.

    Raises:
        ValueError: any option that cannot work, naming the fix.
    """

    data_parallel_size: Size = "auto"
    pipeline_parallel_size: Size = 1
    tensor_parallel_size: Size = 1
    zero_stage: int = 0
    microbatches: int = 4
    schedule: str = "1f1b"
    partition: Union[str, tuple[int, ...]] = "parameters"
    stages_per_rank: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    plan: Optional[Mapping[str, Any]] = field(default=None, hash=False)
    save_distributed_checkpoint: bool = True
    async_save: bool = False
    timeout: Optional[Union[timedelta, int, float]] = None
    activation_checkpointing: Choice = "none"
    compile: Compile = False
    param_dtype: Optional[str] = None
    reduce_dtype: str = "float32"
    data_replicate_size: Optional[int] = None
    data_shard_size: Optional[int] = None
    comm_hook: str = "none"
    bucket_size_mb: Optional[float] = None
    find_unused_parameters: bool = False
    fsdp_prefetch: Optional[int] = None
    offload: str = "none"
    context_parallel_size: Size = 1
    context_parallel_method: str = "ring"
    expert_parallel_size: int = 1
    expert_data_shard: bool = False
    float8: Optional[str] = None
    float8_all_gather: Optional[bool] = None

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "pipeline_parallel_size", "tensor_parallel_size"):
            check_size(name, getattr(self, name))
        checks.check_zero_stage(self.zero_stage)
        checks.check_tensor_flags(self.tensor_parallel_size, loss_parallel=self.loss_parallel,
                                  sequence_parallel=self.sequence_parallel)
        # Only what holds for any world here: micro-batches against the pipeline size are checked once the world
        # is known (check_module), after the sizes, so a size too large for the world is reported as that.
        validate_schedule(self.schedule, 1, self.stages_per_rank, self.microbatches)
        object.__setattr__(self, "partition", checks.check_partition(plain(self.partition)))
        object.__setattr__(self, "plan", plain(self.plan))
        object.__setattr__(self, "timeout", as_timeout(self.timeout))
        object.__setattr__(self, "activation_checkpointing", check_choice(plain(self.activation_checkpointing)))
        if self.compile is not False:
            compile_backend(self.compile)  # refuses a value that names no backend
            check_compile(self.compile, self.activation_checkpointing, self.tensor_parallel_size)
        check_dtype_option("param_dtype", self.param_dtype, allow_none=True)
        object.__setattr__(self, "reduce_dtype", checks.comm_hook_reduce_dtype(self.comm_hook, self.reduce_dtype))
        check_dtype_option("reduce_dtype", self.reduce_dtype, allow_none=False)
        checks.check_data_split(self.zero_stage, self.data_replicate_size, self.data_shard_size)
        checks.check_bucket(self.zero_stage, self.bucket_size_mb, self.fsdp_prefetch)
        checks.check_prefetch(self.fsdp_prefetch, self.zero_stage)
        checks.check_offload(self.offload, self.zero_stage)
        checks.check_context(self.context_parallel_size, self.expert_parallel_size, self.context_parallel_method)
        check_float8_options(self.float8, self.float8_all_gather, self.zero_stage)
        if self.expert_data_shard and self.expert_parallel_size == 1:
            raise ValueError("expert_data_shard=True shards the experts each expert-parallel rank holds; with "
                             "expert_parallel_size=1 there are none: set expert_parallel_size > 1, or shard every "
                             "parameter with zero_stage=3.")
        if self.async_save and not self.save_distributed_checkpoint:
            raise ValueError("async_save=True writes the sharded folder in the background; with "
                             "save_distributed_checkpoint=False there is none: keep the folder or save synchronously.")

    @property
    def bucket_bytes(self) -> int:
        """Bytes of one data-axis unit: ``bucket_size_mb`` (None: 25 MB under ``zero_stage=0``, else 0: per layer)."""
        if self.zero_stage:
            return int((self.bucket_size_mb or 0) * 2**20)
        return int((25 if self.bucket_size_mb is None else self.bucket_size_mb) * 2**20)

    def layout(self, world_size: int, names: Optional[Mapping[str, str]] = None, num_nodes: int = 1
               ) -> ParallelLayout:
        """The layout these options ask for on ``world_size`` ranks (no processes needed).

        Args:
            world_size: processes in the run.
            names: how errors spell the settings (default :data:`SIZE_NAMES`, the hybrid strategy's argument names).
            num_nodes: nodes in the run, for the messages.

        Raises:
            ValueError: sizes that do not fit ``world_size``, naming the fix.
        """
        names = names or SIZE_NAMES
        return ParallelLayout.resolve(world_size, self.data_parallel_size, self.pipeline_parallel_size,
                                      self.tensor_parallel_size, names=names, num_nodes=num_nodes,
                                      data_replicate=self.data_replicate_size, data_shard=self.data_shard_size,
                                      context_parallel=self.context_size_for(world_size, names),
                                      expert_parallel=self.expert_parallel_size)

    def context_size_for(self, world_size: int, names: Mapping[str, str]) -> int:
        """The context size: explicit, or with ``"auto"`` what the (then explicit) other sizes leave of the world.

        Args:
            world_size: processes in the run.
            names: how messages spell the sizes (``{"data_parallel": "data_parallel_size", ...}``).
        """
        if self.context_parallel_size != "auto":
            return self.context_parallel_size
        others = {"data_parallel": self.data_parallel_size, "pipeline_parallel": self.pipeline_parallel_size,
                  "tensor_parallel": self.tensor_parallel_size}
        explicit = "auto" not in others.values()
        product = math.prod(others.values()) if explicit else 0
        if not explicit or world_size % product:
            given = ", ".join(f"{names.get(k, k)}={v!r}" for k, v in others.items())
            raise ValueError(f"{names.get('context_parallel', 'context_parallel')}='auto' takes what the other sizes "
                             f"leave of {world_size} processes, but they are {given}: give them explicit sizes whose "
                             f"product divides {world_size}, or give the context size.")
        return world_size // product

    def num_stages(self, pipeline_parallel: int) -> int:
        """Pipeline stages in all for ``pipeline_parallel`` ranks."""
        return pipeline_parallel * self.stages_per_rank

    @property
    def settings(self) -> tuple[Any, ...]:
        """What decides how a module is split and sharded (a parallelised module cannot change them)."""
        return (self.schedule, self.stages_per_rank, self.partition, self.zero_stage, self.sequence_parallel,
                self.loss_parallel, repr(self.plan), self.activation_checkpointing, self.param_dtype, self.reduce_dtype,
                self.data_replicate_size, self.data_shard_size, self.bucket_size_mb, self.fsdp_prefetch,
                self.offload, self.context_parallel_size, self.context_parallel_method, self.expert_parallel_size,
                self.compile, self.find_unused_parameters, self.expert_data_shard, self.float8,
                self.float8_all_gather)


def option_names() -> tuple[str, ...]:
    """The fields of :class:`ParallelOptions`, in order (what a strategy takes as option keywords)."""
    from dataclasses import fields

    return tuple(f.name for f in fields(ParallelOptions))


def _unknown_option_error(owner: str, unknown: Sequence[str], also: Sequence[str]) -> ValueError:
    import difflib

    valid, hints = [*option_names(), *also], []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ValueError(f"{owner} got unknown option(s) {', '.join(hints)}: the options are the fields of "
                      f"ParallelOptions ({', '.join(option_names())}) plus {', '.join(also)}. Fix the name.")


def options_from(
    options: Union[None, ParallelOptions, Mapping[str, Any]],
    option_kwargs: Mapping[str, Any],
    owner: str = "HybridParallelStrategy",
    also: Sequence[str] = ("process_group_backend", "load_optimizer_state"),
) -> ParallelOptions:
    """One :class:`ParallelOptions` from a strategy's ``options`` and its option keywords.

    Args:
        options: a ``ParallelOptions`` (or a mapping of its fields, e.g. from Hydra), or None.
        option_kwargs: fields of ``ParallelOptions`` given by name.
        owner: the class the options are for (in messages).
        also: the owner's own arguments (listed as valid in the unknown-name message).

    Raises:
        ValueError: an unknown name (with the closest valid one), ``options`` of another type, or a keyword
            that contradicts ``options`` (naming ``dataclasses.replace`` as the fix); invalid values.
    """
    unknown = [name for name in option_kwargs if name not in option_names()]
    if unknown:
        raise _unknown_option_error(owner, unknown, also)
    if options is None:
        return ParallelOptions(**option_kwargs)
    if isinstance(options, Mapping):  # Hydra's DictConfig is one
        options = options_from(None, dict(plain(options)), owner, also)
    if not isinstance(options, ParallelOptions):
        raise ValueError(f"{owner}(options={options!r}): options is a ParallelOptions (or None); every option is a "
                         f"keyword, e.g. {owner}(pipeline_parallel_size=2) or {owner}(options=ParallelOptions(...)).")
    merged = replace(options, **option_kwargs)
    clashes = [f"{name}={option_kwargs[name]!r} (options has {getattr(options, name)!r})"
               for name in option_kwargs if getattr(merged, name) != getattr(options, name)]
    if clashes:
        raise ValueError(f"{owner} got options= and keywords that contradict it: {', '.join(clashes)}. Pass one of "
                         "them: options=dataclasses.replace(options, ...) with the new values, or the keywords alone.")
    return options
