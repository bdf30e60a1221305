"""Checkpoints, by format and then by direction (none imports Lightning's trainer; private APIs go
through :mod:`lightning_parallel._compat`):

- :mod:`.dcp`: the suite's own folder format on ``torch.distributed.checkpoint``: atomic save (hidden
  ``.partial`` folder, then a rename), load onto any layout, crash fallback.
- :mod:`.pt`: a DCP folder -> one plain ``state_dict`` ``.pt`` file.
- :mod:`.lightning`: Lightning's single files and DCP folders read into the suite's keys
  (:mod:`.lightning.reader`), and a suite folder written as one ``.ckpt`` that Lightning's ``auto``/``ddp``
  resume exactly (:mod:`.lightning.writer`).
- :mod:`.deepspeed`: a DeepSpeed ZeRO 0-3 folder's weights, Lightning state and per-parameter optimizer
  state (:mod:`.deepspeed.folder`, :mod:`.deepspeed.optimizer`), converted to a DCP folder or one ``.pt``
  (:mod:`.deepspeed.convert`).
- :mod:`.hf`: a ``save_pretrained`` folder onto any layout, each rank reading its slices (:mod:`.hf.load`);
  a checkpoint out to a folder ``from_pretrained`` loads (:mod:`.hf.export`); the ``hugging_face`` entry
  (prefix, class, config) it is written from (:mod:`.hf.metadata`).
- :mod:`.detect`: which writer made a checkpoint (suite, Lightning single file or DCP folder, DeepSpeed)
  and the message that names the fix for one the suite cannot read.
- :mod:`.safe_loading`: the allow-listed DCP reader and planner (:class:`CheckpointRefused`);
  :mod:`.memory_reader`: a DCP reader over full (memory-mapped) tensors, so a single file loads onto any
  layout through the same resharding path as a folder.
- :mod:`.resume`: the one load path a strategy's ``load_checkpoint`` calls for every writer.

The ``lp-convert`` command over all of them is :mod:`lightning_parallel.cli.convert`.
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
from lightning_parallel.checkpoints.deepspeed.convert import convert_checkpoint, convert_to_dcp
from lightning_parallel.checkpoints.deepspeed.folder import consolidate_state_dict, read_lightning_state
from lightning_parallel.checkpoints.deepspeed.optimizer import consolidate_optimizer_state
from lightning_parallel.checkpoints.detect import (
    identify_writer,
    read_lightning_checkpoint,
    unreadable_checkpoint_error,
)
from lightning_parallel.checkpoints.hf.export import export_hf_folder
from lightning_parallel.checkpoints.hf.load import load_hf_weights
from lightning_parallel.checkpoints.lightning.writer import (
    convert_to_lightning,
    parameter_order_entry,
    to_lightning_checkpoint,
)
from lightning_parallel.checkpoints.memory_reader import InMemoryReader
from lightning_parallel.checkpoints.pt import consolidate, export_state_dict
from lightning_parallel.checkpoints.resume import resume_from
from lightning_parallel.checkpoints.safe_loading import CheckpointRefused, SafeFileSystemReader, SafeLoadPlanner

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
