"""Checkpoints: the suite's sharded folder format, DeepSpeed conversion and export to one file.

Modules, one job each (none imports Lightning's trainer; private APIs go through
:mod:`lightning_parallel._compat`):

- :mod:`.safe_loading`: the allow-listed DCP reader and planner (:class:`CheckpointRefused`).
- :mod:`.dcp`: the folder format: atomic save (hidden ``.partial`` folder, then a rename),
  load onto any layout, crash fallback.
- :mod:`.deepspeed_reader` and :mod:`.deepspeed_optimizer`: a DeepSpeed ZeRO 0-3 folder's
  weights, Lightning state and per-parameter optimizer state.
- :mod:`.from_deepspeed`: DeepSpeed folder -> DCP folder (resumable) or one ``.pt`` file.
- :mod:`.export`: DCP folder -> one ``.pt`` file.
- :mod:`.convert`: the ``lp-convert`` command over all of them.
"""

from lightning_parallel.checkpoints.dcp import (
    METADATA_FILE,
    commit,
    is_sharded_checkpoint,
    load_sharded_checkpoint,
    optimizer_state_dict,
    partial_path,
    resolve_checkpoint,
    save_on_one_process,
    save_sharded_checkpoint,
    write_shards,
)
from lightning_parallel.checkpoints.deepspeed_optimizer import consolidate_optimizer_state
from lightning_parallel.checkpoints.deepspeed_reader import consolidate_state_dict, read_lightning_state
from lightning_parallel.checkpoints.export import consolidate, export_state_dict
from lightning_parallel.checkpoints.from_deepspeed import convert_checkpoint, convert_to_dcp
from lightning_parallel.checkpoints.safe_loading import CheckpointRefused, SafeFileSystemReader, SafeLoadPlanner

__all__ = [
    "METADATA_FILE",
    "CheckpointRefused",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "commit",
    "consolidate",
    "consolidate_optimizer_state",
    "consolidate_state_dict",
    "convert_checkpoint",
    "convert_to_dcp",
    "export_state_dict",
    "is_sharded_checkpoint",
    "load_sharded_checkpoint",
    "optimizer_state_dict",
    "partial_path",
    "read_lightning_state",
    "resolve_checkpoint",
    "save_on_one_process",
    "save_sharded_checkpoint",
    "write_shards",
]
