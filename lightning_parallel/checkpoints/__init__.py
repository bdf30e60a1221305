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
- :mod:`.foreign`: which writer made a checkpoint (suite, Lightning single file or DCP folder,
  DeepSpeed) and the message that names the fix for one the suite cannot read;
  :mod:`.lightning_reader` reads Lightning's files into the suite's keys.
- :mod:`.memory_reader`: a DCP reader over full (memory-mapped) tensors, so a single file
  loads onto any layout through the same resharding path as a folder.
- :mod:`.resume`: the one load path a strategy's ``load_checkpoint`` calls for every writer.
- :mod:`.to_lightning`: suite folder -> one Lightning ``.ckpt`` that Lightning's ``auto``/``ddp``
  resume exactly (optimizer state keyed by index in the recorded ``configure_optimizers`` order).
- :mod:`.hf_in` / :mod:`.hf_out`: a ``save_pretrained`` folder onto any layout (each rank reads its
  slices) / a checkpoint out to a folder ``from_pretrained`` loads.
- :mod:`.hf_metadata`: the ``hugging_face`` entry (prefix, class, config) a Hugging Face folder is written from.
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
from lightning_parallel.checkpoints.foreign import (
    identify_writer,
    read_lightning_checkpoint,
    unreadable_checkpoint_error,
)
from lightning_parallel.checkpoints.from_deepspeed import convert_checkpoint, convert_to_dcp
from lightning_parallel.checkpoints.hf_in import load_hf_weights
from lightning_parallel.checkpoints.hf_out import export_hf_folder
from lightning_parallel.checkpoints.memory_reader import InMemoryReader
from lightning_parallel.checkpoints.resume import resume_from
from lightning_parallel.checkpoints.safe_loading import CheckpointRefused, SafeFileSystemReader, SafeLoadPlanner
from lightning_parallel.checkpoints.to_lightning import (
    convert_to_lightning,
    parameter_order_entry,
    to_lightning_checkpoint,
)

__all__ = [
    "CheckpointRefused",
    "InMemoryReader",
    "METADATA_FILE",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "commit",
    "consolidate",
    "consolidate_optimizer_state",
    "consolidate_state_dict",
    "convert_checkpoint",
    "convert_to_dcp",
    "convert_to_lightning",
    "export_hf_folder",
    "export_state_dict",
    "identify_writer",
    "is_sharded_checkpoint",
    "load_hf_weights",
    "load_sharded_checkpoint",
    "optimizer_state_dict",
    "parameter_order_entry",
    "partial_path",
    "read_lightning_checkpoint",
    "read_lightning_state",
    "resolve_checkpoint",
    "resume_from",
    "save_on_one_process",
    "save_sharded_checkpoint",
    "to_lightning_checkpoint",
    "unreadable_checkpoint_error",
    "write_shards",
]
