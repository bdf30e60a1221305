"""Sharded checkpoints on ``torch.distributed.checkpoint`` (DCP), for any mix of pipeline stages,
DTensor shards and plain replicated tensors.

A checkpoint is a folder: DCP shards of ``{"state_dict": ..., "optimizer_0": ...}`` with every
tensor under its unsplit name and full shape (pipeline stages keep their original layer
names; DTensors are stored whole), plus ``meta.pt`` with Lightning's own state (loops,
callbacks, schedulers). DCP plans the writes so each rank writes its own tensors once, and
reshards on load: a rank reads exactly the slices its current layout holds.

Note:
    Lightning's ``ModelParallelStrategy`` writes this same layout but its loader insists on
    a model holding DTensors; a pipeline-only or replicated model holds none, so loading is
    done here with DCP directly. Optimizer state is *flattened* (one key per parameter and
    setting, as torchtitan does): the nested form stores ``param_groups`` as one object per
    checkpoint, which DCP de-duplicates across ranks -- pipeline stages, whose groups list
    different parameters, would then load another stage's groups.

    Reading goes through :mod:`~lightning_parallel.checkpoints.safe_loading` (allow-listed
    metadata, ``weights_only=True`` for every other entry).
"""

from lightning_parallel.checkpoints.dcp.reader import (
    check_entries,
    check_group_agreement,
    is_sharded_checkpoint,
    load_model_and_optimizers,
    load_sharded_checkpoint,
    optimizer_state_dict,
    read_nested_param_groups,
)
from lightning_parallel.checkpoints.dcp.writer import (
    METADATA_FILE,
    commit,
    partial_path,
    resolve_checkpoint,
    save_on_one_process,
    save_sharded_checkpoint,
    single_process,
    write_shards,
)

__all__ = [
    "METADATA_FILE", "check_entries", "check_group_agreement", "commit", "is_sharded_checkpoint",
    "load_model_and_optimizers", "load_sharded_checkpoint", "optimizer_state_dict", "partial_path",
    "read_nested_param_groups", "resolve_checkpoint", "save_on_one_process", "save_sharded_checkpoint",
    "single_process", "write_shards",
]
