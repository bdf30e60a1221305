"""Pipeline parallelism on ``torch.distributed.pipelining``: split a module, build a schedule, run steps.

What torch provides and is used as is: ``PipelineStage`` (send/recv, shape inference,
per-micro-batch backward) and the schedules (GPipe, 1F1B, interleaved, zero-bubble).
What it lacks and is written here:

* splitting a module that follows the protocol (``pipeline_layers()``) into stages while
  keeping every parameter under its original name, so checkpoints load under any
  pipeline size (torchtitan's approach: unowned layers are replaced by an empty
  placeholder, so ``module.state_dict()`` holds only this rank's layers, by their names);
* a choice of schedule by name, with the combinations torch refuses (or silently
  degrades) turned into early ``ValueError`` s;
* one call per training batch that returns the batch's mean loss on *every* pipeline
  rank, not just the last stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parallel.parallel.partition import Partition, parameter_counts, stage_of_layer

# name -> (schedule class name in torch.distributed.pipelining.schedules, stages per rank rule, placement style)
SCHEDULES: dict[str, tuple[str, str, str]] = {
    "gpipe": ("ScheduleGPipe", "one", "loop"),
    "1f1b": ("Schedule1F1B", "one", "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "many", "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", "many", "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", "many", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "two", "v"),
    "dualpipev": ("ScheduleDualPipeV", "two", "v"),
}


def available_schedules() -> list[str]:
    """Schedule names whose torch class exists in the installed torch."""
    from torch.distributed.pipelining import schedules

    return [name for name, (cls, _, _) in SCHEDULES.items() if hasattr(schedules, cls)]


def validate_schedule(schedule: str, pipeline_parallel: int, stages_per_rank: int, microbatches: int) -> None:
    """Reject a schedule / stages-per-rank / micro-batch combination torch would refuse or mishandle.

    Args:
        schedule: a key of :data:`SCHEDULES`.
        pipeline_parallel: pipeline ranks.
        stages_per_rank: stages held by each rank (virtual stages).
        microbatches: micro-batches per batch.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}.")
    if schedule not in available_schedules():
        raise ValueError(
            f"schedule={schedule!r} needs a newer torch ({torch.__version__} lacks it): use one of {available_schedules()}."
        )
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r} must be a positive integer.")
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int) or stages_per_rank < 1:
        raise ValueError(f"stages_per_rank={stages_per_rank!r} must be a positive integer.")
    _, rule, _ = SCHEDULES[schedule]
    if rule == "one" and stages_per_rank != 1:
        multi = [n for n, (_, r, _) in SCHEDULES.items() if r != "one"]
        raise ValueError(
            f"schedule={schedule!r} runs one stage per rank, but stages_per_rank={stages_per_rank}: set "
            f"stages_per_rank=1, or use {multi}."
        )
    if rule == "many" and stages_per_rank < 2:
        raise ValueError(
            f"schedule={schedule!r} interleaves several stages per rank, but stages_per_rank={stages_per_rank}: "
            "set stages_per_rank >= 2, or use schedule='1f1b'."
        )
    if rule == "two" and stages_per_rank != 2:
        raise ValueError(
            f"schedule={schedule!r} is a V schedule with exactly two stages per rank, but stages_per_rank="
            f"{stages_per_rank}: set stages_per_rank=2."
        )
    num_stages = pipeline_parallel * stages_per_rank
    if schedule in ("1f1b", "dualpipev") and microbatches < num_stages:
        raise ValueError(
            f"schedule={schedule!r} needs at least as many micro-batches as stages: microbatches={microbatches} < "
            f"{num_stages} stages (pipeline_parallel_size={pipeline_parallel} x stages_per_rank={stages_per_rank}). "
            f"Fix: microbatches >= {num_stages} (dividing the batch size), or fewer stages."
        )
    if rule == "many" and pipeline_parallel > 1 and microbatches % pipeline_parallel:
        raise ValueError(
            f"schedule={schedule!r} runs micro-batches in rounds of the pipeline size: microbatches={microbatches} "
            f"must be a multiple of pipeline_parallel_size={pipeline_parallel}."
        )


def stage_ids_for_rank(schedule: str, pipeline_rank: int, pipeline_parallel: int, stages_per_rank: int) -> list[int]:
    """The stage indices a pipeline rank runs (loop placement, or V placement for zbv/dualpipev)."""
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    num_stages = pipeline_parallel * stages_per_rank
    style = SCHEDULES[schedule][2]
    mapping = generate_stage_to_rank_mapping(pipeline_parallel, num_stages, style=style)
    return sorted(stage for stage, rank in mapping.items() if rank == pipeline_rank)


class RemovedLayer(nn.Module):
    """Stands in for a layer that lives on another pipeline stage (holds no parameters).

    Args:
        name: the layer's qualified name in the module.
        stage: the stage that owns it.
    """

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.layer_name, self.stage = name, stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"Layer {self.layer_name!r} lives on pipeline stage {self.stage}; this rank cannot run it. "
            "Under a pipeline strategy the forward pass runs through the pipeline schedule, not module(x)."
        )

    def extra_repr(self) -> str:
        return f"{self.layer_name!r} on stage {self.stage}"


def layer_names(module: nn.Module, layers: Sequence[nn.Module]) -> list[str]:
    """Qualified names of ``layers`` inside ``module``, checking they partition its parameters.

    Raises:
        ValueError: a layer that is not a submodule, layers nested in each other, a parameter
            outside every layer, or a parameter shared by two layers (tied weights).
    """
    by_id = {id(m): name for name, m in module.named_modules()}
    names = []
    for index, layer in enumerate(layers):
        name = by_id.get(id(layer))
        if not name:
            raise ValueError(
                f"pipeline_layers()[{index}] ({type(layer).__name__}) is not a submodule of {type(module).__name__} "
                "(or is the module itself): return the model's own blocks, in order."
            )
        names.append(name)
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"pipeline layers {a!r} and {b!r} are nested: return non-overlapping blocks.")
    owner: dict[int, str] = {}
    for name, layer in zip(names, layers):
        for pname, param in layer.named_parameters():
            if id(param) in owner and owner[id(param)] != name:
                raise ValueError(
                    f"Parameter {name}.{pname} is shared with layer {owner[id(param)]!r} (tied weights): a pipeline "
                    "cannot split tied layers across stages. Untie them."
                )
            owner[id(param)] = name
    orphans = [n for n, p in module.named_parameters() if id(p) not in owner]
    if orphans:
        raise ValueError(
            f"Parameters outside every pipeline layer would be lost by the split: {orphans[:5]}. "
            "Include the modules that hold them in pipeline_layers()."
        )
    return names


class StageModule(nn.Module):
    """The layers of one pipeline stage, registered under their original qualified names.

    The layers are the very module objects of the full model (not copies), so training
    them trains the model, and ``state_dict()`` keys match the unsplit model's.

    Args:
        named_layers: ``(qualified name, layer)`` pairs in forward order.
    """

    def __init__(self, named_layers: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.order = [name for name, _ in named_layers]
        for name, layer in named_layers:
            parent: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, layer)

    def forward(self, x: Tensor) -> Tensor:
        for name in self.order:
            x = self.get_submodule(name)(x)
        return x


@dataclass(frozen=True)
class PipelineSplit:
    """Which layers each stage owns, and what this rank holds.

    Attributes:
        names: qualified name of every pipeline layer, in order.
        bounds: stage boundaries (``num_stages + 1`` layer indices).
        local_stages: stage indices this rank runs.
        parameters_per_stage: parameter elements of each stage.
    """

    names: tuple[str, ...]
    bounds: tuple[int, ...]
    local_stages: tuple[int, ...]
    parameters_per_stage: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def stage_layers(self, stage: int) -> tuple[str, ...]:
        return self.names[self.bounds[stage] : self.bounds[stage + 1]]

    def describe(self) -> dict[str, str]:
        """One line per stage: its layers and parameter count (for the start-up table)."""
        rows = {}
        for stage in range(self.num_stages):
            layers = self.stage_layers(stage)
            span = layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]}"
            rows[f"stage {stage}"] = f"{len(layers)} layer(s) ({span}), {self.parameters_per_stage[stage]:,} params"
        return rows


def split_module(
    module: nn.Module, layers: Sequence[nn.Module], bounds: Partition, local_stages: Sequence[int]
) -> tuple[PipelineSplit, list[StageModule]]:
    """Keep only this rank's stages in ``module``; return the split and the local stage modules.

    Layers of other stages are replaced in ``module`` by :class:`RemovedLayer`, freeing
    their parameters, so ``module.parameters()`` (what ``configure_optimizers`` sees) and
    ``module.state_dict()`` hold this rank's layers only, under their original names.

    Args:
        module: the full model (modified in place).
        layers: its ``pipeline_layers()``.
        bounds: stage boundaries from :func:`~lightning_parallel.parallel.partition.partition_layers`.
        local_stages: stage indices this rank runs.
    """
    names = layer_names(module, layers)
    counts = parameter_counts(layers)
    owner = stage_of_layer(list(bounds))
    per_stage = tuple(sum(counts[bounds[s] : bounds[s + 1]]) for s in range(len(bounds) - 1))
    split = PipelineSplit(tuple(names), tuple(bounds), tuple(local_stages), per_stage)
    stages = [StageModule([(names[i], layers[i]) for i in range(bounds[s], bounds[s + 1])]) for s in local_stages]
    for index, name in enumerate(names):
        if owner[index] not in local_stages:
            module.set_submodule(name, RemovedLayer(name, owner[index]))
    return split, stages


def check_microbatches(batch_size: int, microbatches: int) -> None:
    """A batch must split into equal micro-batches (torch would silently use fewer)."""
    if batch_size < microbatches or batch_size % microbatches:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise ValueError(
            f"A batch of {batch_size} samples per data-parallel rank does not split into microbatches={microbatches} "
            f"equal micro-batches. Use a per-device batch size that is a multiple of {microbatches}, or microbatches "
            f"in {divisors}. (Keep drop_last=True so the last batch is not smaller.)"
        )


class PipelineRunner:
    """Runs one pipeline schedule over this rank's stages, and agrees on the loss.

    Args:
        stages: this rank's stage modules (in stage order).
        stage_ids: their stage indices.
        num_stages: total stages.
        schedule: a key of :data:`SCHEDULES`.
        microbatches: micro-batches per batch.
        loss_fn: ``(output, target) -> mean loss`` of one micro-batch.
        device: where the stages run.
        group: the pipeline process group.
        last_stage_rank: global rank of the process holding the last stage (in ``group``).
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        stage_ids: Sequence[int],
        num_stages: int,
        schedule: str,
        microbatches: int,
        loss_fn: Callable[[Any, Any], Tensor],
        device: torch.device,
        group: dist.ProcessGroup,
        last_stage_rank: int,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        self.microbatches = microbatches
        self.group, self.last_stage_rank = group, last_stage_rank
        self.loss_scale = 1.0
        self._predicting = False
        self._user_loss = loss_fn
        self.stages = [PipelineStage(mod, idx, num_stages, device, group=group) for mod, idx in zip(stages, stage_ids)]
        self.has_first = 0 in stage_ids
        self.has_last = num_stages - 1 in stage_ids
        cls = getattr(schedules, SCHEDULES[schedule][0])
        single = SCHEDULES[schedule][1] == "one"
        # Each micro-batch loss is divided by the micro-batch count in _loss, so the summed
        # gradients are those of the batch's mean loss. torch's scale_grads=True would instead
        # divide the whole .grad after the step -- including gradients accumulated from
        # earlier batches (accumulate_grad_batches), which must not be rescaled.
        self.microbatch_scale = 1.0 / microbatches
        self.schedule = cls(
            self.stages[0] if single else self.stages,
            n_microbatches=microbatches,
            loss_fn=self._loss,
            scale_grads=False,
        )
        self._batch_size: Optional[int] = None

    def _loss(self, output: Any, target: Any) -> Tensor:
        if self._predicting:  # torch computes a loss whenever a loss_fn is set; predict has no targets
            return torch.zeros((), device=output.device)
        # loss_scale carries 1/accumulate_grad_batches, as Lightning scales a closure loss.
        return self._user_loss(output, target) * (self.loss_scale * self.microbatch_scale)

    def _check_batch(self, inputs: Tensor) -> None:
        size = int(inputs.shape[0])
        check_microbatches(size, self.microbatches)
        if self._batch_size not in (None, size):
            raise ValueError(
                f"The batch size changed from {self._batch_size} to {size}: pipeline stages are built for fixed "
                "shapes (pytorch#159942). Use drop_last=True and the same batch size for training and evaluation."
            )
        self._batch_size = size

    def _mean_loss(self, losses: list[Tensor], device: torch.device) -> Tensor:
        """Mean micro-batch loss, sent from the last stage to every pipeline rank."""
        if self.has_last:
            value = torch.stack([loss.detach().float() for loss in losses]).mean() / (
                self.loss_scale * self.microbatch_scale
            )
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            value = value.to(device)
        else:
            value = torch.zeros((), device=device)
        dist.broadcast(value, src=self.last_stage_rank, group=self.group)
        return value

    def train_step(self, inputs: Tensor, targets: Tensor, loss_scale: float = 1.0) -> Tensor:
        """Forward and backward of every micro-batch; gradients accumulate into ``.grad``.

        Args:
            inputs: the batch's model input (used by the first stage).
            targets: its targets (used by the last stage).
            loss_scale: multiplies each micro-batch loss before backward (1/accumulation).

        Returns:
            The batch's mean loss (unscaled), identical on every pipeline rank.
        """
        self._check_batch(inputs)
        self.loss_scale = loss_scale
        losses: list[Tensor] = []
        args = (inputs,) if self.has_first else ()
        self.schedule.step(
            *args,
            target=targets if self.has_last else None,
            losses=losses if self.has_last else None,
            return_outputs=False,
        )
        return self._mean_loss(losses, inputs.device)

    def eval_step(self, inputs: Tensor, targets: Optional[Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """Forward only. Returns (mean loss or None without targets, outputs on the last stage else None)."""
        self._check_batch(inputs)
        self.loss_scale = 1.0
        losses: list[Tensor] = []
        with_loss = targets is not None
        self._predicting = not with_loss
        args = (inputs,) if self.has_first else ()
        target = targets if with_loss else torch.zeros(inputs.shape[0], device=inputs.device)
        try:
            with torch.no_grad():
                outputs = self.schedule.eval(
                    *args, target=target if self.has_last else None, losses=losses if self.has_last else None
                )
        finally:
            self._predicting = False
        loss = self._mean_loss(losses, inputs.device) if with_loss else None
        return loss, outputs if self.has_last else None

    def broadcast_outputs(self, outputs: Optional[Tensor]) -> Tensor:
        """Send the last stage's outputs to every pipeline rank (predict returns them everywhere)."""
        box = [outputs.cpu() if outputs is not None else None]
        dist.broadcast_object_list(box, src=self.last_stage_rank, group=self.group)
        return box[0]
