"""Pipeline parallelism on ``torch.distributed.pipelining``: split a module, build a schedule, run steps.

What torch provides and is used as is: ``PipelineStage`` (send/recv, shape inference,
per-micro-batch backward) and the schedules (GPipe, 1F1B, interleaved, zero-bubble).
What it lacks is written in four modules with one job each, re-exported here:

* :mod:`.pipeline_schedules` -- a choice of schedule by name, with the combinations torch
  refuses (or silently degrades) turned into early ``ValueError`` s;
* :mod:`.stages` -- splitting a module into stages while keeping every parameter under its
  original name, so checkpoints load under any pipeline size (torchtitan's approach:
  unowned layers are replaced by an empty placeholder), with several tensors between
  stages and per-micro-batch side inputs;
* :mod:`.pipeline_tied` -- a parameter tied across stages (embedding and LM head) kept
  identical on the ranks holding it;
* :mod:`.pipeline_runner` -- one call per training batch that returns the batch's loss on
  *every* pipeline rank, token-weighted when the loss comes as ``(sum, count)`` terms.
"""

from lightning_parallel.parallel.pipeline_runner import PipelineRunner
from lightning_parallel.parallel.pipeline_schedules import (
    SCHEDULES,
    available_schedules,
    check_microbatches,
    stage_ids_for_rank,
    validate_schedule,
)
from lightning_parallel.parallel.stages import (
    PipelineSplit,
    RemovedLayer,
    StageModule,
    layer_names,
    shared_parameters,
    split_module,
)

__all__ = [
    "SCHEDULES",
    "PipelineRunner",
    "PipelineSplit",
    "RemovedLayer",
    "StageModule",
    "available_schedules",
    "check_microbatches",
    "layer_names",
    "shared_parameters",
    "split_module",
    "stage_ids_for_rank",
    "validate_schedule",
]
