"""Pipeline schedules by name: which torch class runs each, and the combinations refused up front.

torch.distributed.pipelining refuses some schedule / stages-per-rank / micro-batch
combinations at run time (or silently degrades, e.g. fewer micro-batches than asked,
pytorch#126600); each is turned into an early ``ValueError`` that names the fix.
"""

from __future__ import annotations

import torch

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


def _unknown_schedule(schedule: object) -> str:
    """The message for a schedule name torch does not have, with the closest one."""
    import difflib

    near = difflib.get_close_matches(str(schedule), list(SCHEDULES), n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    return f"Unknown schedule {schedule!r}: {hint}choose one of {', '.join(SCHEDULES)}."


def validate_schedule(schedule: str, pipeline_parallel: int, stages_per_rank: int, microbatches: int) -> None:
    """Reject a schedule / stages-per-rank / micro-batch combination torch would refuse or mishandle.

    Args:
        schedule: a key of :data:`SCHEDULES`.
        pipeline_parallel: pipeline ranks.
        stages_per_rank: stages held by each rank (virtual stages).
        microbatches: micro-batches per batch.
    """
    if schedule not in SCHEDULES:
        raise ValueError(_unknown_schedule(schedule))
    if schedule not in available_schedules():
        raise ValueError(
            f"schedule={schedule!r} needs a newer torch ({torch.__version__} lacks it): "
            f"use one of {available_schedules()}."
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


def check_microbatches(batch_size: int, microbatches: int) -> None:
    """A batch must split into equal micro-batches (torch would silently use fewer)."""
    if batch_size < microbatches or batch_size % microbatches:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise ValueError(
            f"A batch of {batch_size} samples per data-parallel rank does not split into microbatches={microbatches} "
            f"equal micro-batches. Use a per-device batch size that is a multiple of {microbatches}, or microbatches "
            f"in {divisors}. (Keep drop_last=True so the last batch is not smaller.)"
        )
