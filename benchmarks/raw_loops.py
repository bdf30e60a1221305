"""Hand-written torch loops that do what each strategy wraps, on the same model, data and optimizer.

Each loop is built from an already-constructed (seeded) GPT, parallelises it the way the
strategy would -- with the same library machinery or the same torch/DeepSpeed call -- and
then runs plain ``zero_grad -> forward/backward -> optimizer.step -> scheduler.step``
steps. Nothing of Lightning is involved: the difference in step time to the Trainer run
is the strategy's (and the Trainer's) overhead.

Note:
    Loops are built lazily (:meth:`RawLoop.build`, called on ``on_train_start``) so they
    can copy settings the strategy resolved during its set-up (the DeepSpeed config) and
    so both sides run in the same process group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from benchmarks.comm import ddp_buckets


def local_bytes(tensor: Tensor | None) -> int:
    """Bytes this rank holds for ``tensor`` (a DTensor counts its local shard; DeepSpeed ZeRO-3 its partition)."""
    if tensor is None:
        return 0
    if hasattr(tensor, "ds_tensor"):
        tensor = tensor.ds_tensor
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.numel() * tensor.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state tensors (AdamW: exp_avg, exp_avg_sq).

    Step counters excluded.
    """
    return sum(
        local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim > 0
    )


def module_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes on this rank (plain torch / DTensor / FSDP2)."""
    params = list(module.parameters())
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params),
        "optim": optimizer_state_bytes(optimizer),
    }


def deepspeed_bytes(engine: Any) -> dict[str, int]:
    """The same counts for a DeepSpeed engine, read from its ZeRO optimizer.

    ``params`` are the model's parameters (ZeRO-3: the local partition), ``master`` the
    fp32 partition the ZeRO optimizer steps (kept even in fp32 training), ``optim`` the
    inner torch optimizer's state, ``grads`` the gradient partitions it holds before the step
    (``averaged_gradients``) or, where those are not kept, the parameters' ``.grad``.
    """
    zero = engine.optimizer
    inner = getattr(zero, "optimizer", zero)
    flats = getattr(zero, "single_partition_of_fp32_groups", None) or getattr(zero, "fp32_partitioned_groups_flat", [])
    grads = 0
    averaged = getattr(zero, "averaged_gradients", None)
    if isinstance(averaged, dict):
        grads = sum(local_bytes(g) for group in averaged.values() for g in (group or []) if torch.is_tensor(g))
    if not grads:
        grads = sum(local_bytes(p.grad) for p in engine.module.parameters())
        grads += sum(local_bytes(f.grad) for f in flats)
    return {
        "params": sum(local_bytes(p) for p in engine.module.parameters()),
        "grads": grads,
        "optim": optimizer_state_bytes(inner),
        "master": sum(local_bytes(f) for f in flats),
    }


def _optimizer_and_scheduler(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """The module's own ``configure_optimizers`` result (same param groups, lr, schedule as the Trainer gets)."""
    config = model.configure_optimizers()
    return config["optimizer"], config["lr_scheduler"]["scheduler"]


class RawLoop:
    """Base: one raw training loop over a model.

    Args:
        model: the seeded model (the loop owns it).
        rank: global rank.
        world_size: number of ranks.
    """

    def __init__(self, model: nn.Module, rank: int, world_size: int) -> None:
        self.model, self.rank, self.world_size = model, rank, world_size
        self.build_seconds = 0.0
        self.capture_memory = False  # set for one step: memory() is read between backward and the optimizer step
        self.captured: dict[str, int] = {}

    def build(self, strategy: Any = None) -> None:
        start = time.perf_counter()
        self._build(strategy)
        self.build_seconds = time.perf_counter() - start

    def _build(self, strategy: Any) -> None:
        self.optimizer, self.scheduler = _optimizer_and_scheduler(self.model)

    # Whether the ranks split the batch: then the loss is the recipe's global token mean (:meth:`_loss`).
    data_parallel = False

    def _loss(self, output: Tensor, targets: Tensor) -> Tensor:
        """The loss the recipe's ``training_step`` forms (``GPT.global_token_mean``): on data-parallel ranks each
        rank's token-loss sum over the mean token count, one all-reduce of (count, sum) per step, so the raw loop
        does the model's own collective as the Trainer does and the overhead measured is the strategy's."""
        if not (self.data_parallel and dist.is_initialized() and dist.get_world_size() > 1):
            return self.model.pipeline_loss(output, targets)
        from examples.nlp.model import token_mean

        def world_mean(t: Tensor) -> Tensor:
            dist.all_reduce(t)
            return t.div_(dist.get_world_size())

        return token_mean(*self.model.pipeline_loss_terms(output, targets), world_mean)

    def _forward_backward(self, inputs: Tensor, targets: Tensor) -> Tensor:
        loss = self._loss(self.model(inputs), targets)
        loss.backward()
        return loss

    def step(self, batch: tuple[Tensor, Tensor]) -> float:
        """One optimizer step on ``batch``; returns this rank's loss."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._forward_backward(*batch)
        self._capture()
        self.optimizer.step()
        self.scheduler.step()
        return float(loss.detach())

    @torch.no_grad()
    def val_loss(self, batches: list) -> float:
        """Mean loss over ``batches`` (this rank's shard), averaged over ranks."""
        self.model.eval()
        total = sum(float(self.model.pipeline_loss(self.model(x), y)) for x, y in batches) / len(batches)
        self.model.train()
        return _world_mean(total)

    def memory(self) -> dict[str, int]:
        return module_bytes(self.model, self.optimizer)

    def _capture(self) -> None:
        if self.capture_memory:
            self.captured, self.capture_memory = self.memory(), False


def _world_mean(value: float) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(box)
    return float(box) / dist.get_world_size()


class RawSingle(RawLoop):
    """One process, plain loop (what Lightning's single-device strategy wraps)."""


class RawDDP(RawLoop):
    """``torch.nn.parallel.DistributedDataParallel`` with its defaults (what Lightning's ``ddp`` wraps).

    Args:
        model: the seeded model.
        rank: global rank.
        world_size: number of ranks.
        bucket_view: ``gradient_as_bucket_view=True`` (gradients live in DDP's buckets, as the hybrid strategy's
            ``zero_stage=0`` data axis builds it).
    """

    def __init__(self, model: nn.Module, rank: int, world_size: int, bucket_view: bool = False) -> None:
        super().__init__(model, rank, world_size)
        self.bucket_view = bucket_view

    def _build(self, strategy: Any) -> None:
        self.module = self.model
        self.ddp = nn.parallel.DistributedDataParallel(self.model, gradient_as_bucket_view=self.bucket_view)
        self.optimizer, self.scheduler = _optimizer_and_scheduler(self.module)

    data_parallel = True

    def _forward_backward(self, inputs: Tensor, targets: Tensor) -> Tensor:
        loss = self._loss(self.ddp(inputs), targets)
        loss.backward()
        return loss

    def ddp_all_reduces(self) -> list[int]:
        return ddp_buckets(self.ddp)


class RawTensor(RawLoop):
    """The plan of ``tensor_parallel_plan()`` applied with ``concrete_plan``/``apply_tensor_parallel`` on a 1-D mesh."""

    def _build(self, strategy: Any) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from lightning_parallel.adapters import adapt
        from lightning_parallel.parallel.tensor.plan import apply_tensor_parallel, concrete_plan

        mesh = init_device_mesh("cpu", (self.world_size,), mesh_dim_names=("tensor_parallel",))
        adapter = adapt(self.model)
        plan = concrete_plan(self.model, None, adapter=adapter)
        apply_tensor_parallel(self.model, mesh["tensor_parallel"], plan, adapter)
        super()._build(strategy)


class RawFSDP2(RawLoop):
    """FSDP2 (``fully_shard``) on every pipeline layer, then the root, over a 1-D data mesh: torchtitan's
    data-parallel recipe and what the hybrid strategy's ZeRO-2/3 data axis builds.

    Args:
        model: the seeded model.
        rank: global rank.
        world_size: number of ranks.
        reshard_after_forward: True for ZeRO-3 (parameters sharded between uses), False for ZeRO-2.
        replicate: HSDP's replica groups (a ``(replicate, world / replicate)`` mesh); 1: the flat data mesh.
    """

    data_parallel = True

    def __init__(self, model: nn.Module, rank: int, world_size: int, reshard_after_forward: bool = True,
                 replicate: int = 1) -> None:
        super().__init__(model, rank, world_size)
        self.reshard_after_forward, self.replicate = reshard_after_forward, replicate

    def _build(self, strategy: Any) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if self.replicate > 1:
            mesh = init_device_mesh("cpu", (self.replicate, self.world_size // self.replicate),
                                    mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (self.world_size,), mesh_dim_names=("data_parallel",))
        for layer in self.model.pipeline_layers():
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        super()._build(strategy)


class RawPipeline(RawLoop):
    """``split_module`` + ``PipelineRunner`` (torch.distributed.pipelining's schedule), same partition and schedule.

    Args:
        schedule: schedule name.
        microbatches: micro-batches per step.
        stages_per_rank: virtual stages per rank.
        partition: partition method (the strategy's default ``parameters``).
    """

    def __init__(self, model: nn.Module, rank: int, world_size: int, schedule: str = "1f1b", microbatches: int = 4,
                 stages_per_rank: int = 1, partition: str = "parameters") -> None:
        super().__init__(model, rank, world_size)
        self.schedule, self.microbatches, self.spr, self.partition = schedule, microbatches, stages_per_rank, partition

    def _build(self, strategy: Any) -> None:
        from lightning_parallel.parallel.pipeline.partition import partition_layers
        from lightning_parallel.parallel.pipeline.runner import PipelineRunner
        from lightning_parallel.parallel.pipeline.schedules import stage_ids_for_rank
        from lightning_parallel.parallel.pipeline.stages import split_module

        p, num_stages = self.world_size, self.world_size * self.spr
        layers = self.model.pipeline_layers()
        stage_ids = stage_ids_for_rank(self.schedule, self.rank, p, self.spr)
        bounds = partition_layers(layers, num_stages, self.partition)
        self.split, self.stages = split_module(self.model, layers, bounds, stage_ids)
        last = next(r for r in range(p) if num_stages - 1 in stage_ids_for_rank(self.schedule, r, p, self.spr))
        self.runner = PipelineRunner(self.stages, stage_ids, num_stages, self.schedule, self.microbatches,
                                     self.model.pipeline_loss, torch.device("cpu"), dist.group.WORLD, last)
        super()._build(strategy)

    def step(self, batch: tuple[Tensor, Tensor]) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.runner.train_step(*batch)
        self._capture()
        self.optimizer.step()
        self.scheduler.step()
        return float(loss)

    def val_loss(self, batches: list) -> float:
        return sum(float(self.runner.eval_step(x, y)[0]) for x, y in batches) / len(batches)


class RawDeepSpeed(RawLoop):
    """``deepspeed.initialize`` with the config the strategy resolved, then ``engine.backward``/``engine.step``."""

    def _build(self, strategy: Any) -> None:
        import argparse

        import deepspeed

        optimizer, self.scheduler = _optimizer_and_scheduler(self.model)
        config = dict(strategy.config)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.rank), model=self.model, optimizer=optimizer,
            config=config, dist_init_required=False,
        )

    data_parallel = True

    def step(self, batch: tuple[Tensor, Tensor]) -> float:
        inputs, targets = batch
        loss = self._loss(self.engine(inputs), targets)
        self.engine.backward(loss, scale_wrt_gas=False)
        self._capture()
        self.engine.step()
        self.scheduler.step()
        return float(loss.detach())

    @torch.no_grad()
    def val_loss(self, batches: list) -> float:
        self.engine.eval()
        total = sum(float(self.model.pipeline_loss(self.engine(x), y)) for x, y in batches) / len(batches)
        self.engine.train()
        return _world_mean(total)

    def memory(self) -> dict[str, int]:
        return deepspeed_bytes(self.engine)


class DeepSpeedPipeline(RawLoop):
    """The anchor: DeepSpeed's ``PipelineModule`` and pipeline engine on the same layers and micro-batches.

    Args:
        microbatches: micro-batches per step (DeepSpeed's gradient accumulation steps).
    """

    def __init__(self, model: nn.Module, rank: int, world_size: int, microbatches: int = 4) -> None:
        super().__init__(model, rank, world_size)
        self.microbatches = microbatches

    def _build(self, strategy: Any) -> None:
        import deepspeed
        from deepspeed.pipe import PipelineModule

        deepspeed.init_distributed(dist_backend="gloo")
        self.pipe = PipelineModule(layers=self.model.pipeline_layers(), num_stages=self.world_size,
                                   loss_fn=self.model.pipeline_loss, partition_method="parameters")
        # Parameters of layers on other stages are not in the PipelineModule: build the
        # optimizer on what it holds, with the recipe's AdamW settings.
        groups = self.model.configure_optimizers()["optimizer"]
        held = {id(p) for p in self.pipe.parameters()}
        param_groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [p for p in g["params"] if id(p) in held]}
            for g in groups.param_groups
        ]
        optimizer = torch.optim.AdamW([g for g in param_groups if g["params"]])
        self.batch_size: int | None = None
        self._optimizer = optimizer

    def _engine(self, batch_size: int) -> None:
        import deepspeed

        micro = batch_size // self.microbatches
        config = {"train_batch_size": batch_size, "train_micro_batch_size_per_gpu": micro,
                  "gradient_accumulation_steps": self.microbatches, "gradient_clipping": 0.0,
                  "steps_per_print": 10**9, "zero_allow_untested_optimizer": True}
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=self.pipe, optimizer=self._optimizer, config=config
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self._optimizer, lambda step: 1.0)
        self.batch_size = batch_size

    def _chunks(self, batch: tuple[Tensor, Tensor]) -> Any:
        inputs, targets = batch
        return iter(zip(inputs.chunk(self.microbatches), targets.chunk(self.microbatches)))

    def step(self, batch: tuple[Tensor, Tensor]) -> float:
        if self.batch_size is None:
            self._engine(int(batch[0].shape[0]))
        loss = float(self.engine.train_batch(data_iter=self._chunks(batch)))
        self._capture()  # DeepSpeed's pipeline engine steps inside train_batch: read after it
        return loss

    def val_loss(self, batches: list) -> float:
        return sum(float(self.engine.eval_batch(self._chunks(b))) for b in batches) / len(batches)

    def memory(self) -> dict[str, int]:
        return module_bytes(self.pipe, self._optimizer)


RAW_LOOPS: dict[str, Callable[..., RawLoop]] = {
    "single": RawSingle,
    "ddp": RawDDP,
    "fsdp2": RawFSDP2,
    "tensor": RawTensor,
    "pipeline": RawPipeline,
    "deepspeed": RawDeepSpeed,
    "deepspeed_pipeline": DeepSpeedPipeline,
}
