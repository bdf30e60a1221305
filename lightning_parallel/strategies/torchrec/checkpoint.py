"""DCP checkpoints for :class:`~lightning_parallel.strategies.torchrec.strategy.TorchRecStrategy`: sharded tables, their
fused optimizer state, the dense optimizers, resharded on load onto any world size and plan.

The folder is the suite's DCP layout (:mod:`lightning_parallel.checkpoints.dcp`: shards plus ``meta.pt``,
written into a hidden folder and renamed when every rank is done) with one more entry:

* ``state_dict``: the LightningModule's weights under their unsplit names; a table is one TorchRec
  ``ShardedTensor`` whose shards each rank writes once, a dense tensor is written once (rank 0);
* ``optimizer_<i>``: the dense optimizers, flattened under parameter names (torch's ``get_optimizer_state_dict``);
* ``table_optimizer``: the tables' optimizer state (Adagrad sums, Adam moments): TorchRec's fused optimizers'
  as ``ShardedTensor`` s, and the twins of replicated (data-parallel) tables as whole tensors under the same
  names (:class:`~lightning_parallel.strategies.torchrec.replicated.TableOptimizers`).

Note:
    DCP reads a ``ShardedTensor`` by the global offsets of each shard, so a checkpoint written table-wise on 2
    ranks loads column-wise on 4: every rank reads exactly the rows and columns its new shards hold, and a
    replicated table's state loads into a sharded one and back (the same names and shapes). Row-wise
    Adagrad keeps one sum per row *and column shard*, which no other plan shares: resume it under the same plan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

from torch import nn
from torch.optim import Optimizer

from lightning_parallel.checkpoints.dcp import (
    METADATA_FILE,
    is_sharded_checkpoint,
    optimizer_state_dict,
    resolve_checkpoint,
    save_sharded_checkpoint,
)
from lightning_parallel.checkpoints.safe_loading import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_plain,
    refusals_unwrapped,
)

TABLE_OPTIMIZER_KEY = "table_optimizer"


def sharded_state(module: nn.Module, optimizers: Sequence[Optimizer], fused: Any) -> dict[str, Any]:
    """This rank's DCP state: ``state_dict``, ``optimizer_<i>`` (flattened), ``table_optimizer``.

    Args:
        module: the LightningModule (its collections sharded by TorchRec).
        optimizers: the dense torch optimizers (empty outside fitting).
        fused: every table's optimizer (a ``state_dict()`` in TorchRec's fused layout), or None.
    """
    state: dict[str, Any] = {"state_dict": module.state_dict()}
    state.update({f"optimizer_{i}": optimizer_state_dict(module, o) for i, o in enumerate(optimizers)})
    if fused is not None and optimizers:
        state[TABLE_OPTIMIZER_KEY] = fused.state_dict()
    return state


def save(path: Path, module: nn.Module, optimizers: Sequence[Optimizer], fused: Any, checkpoint: dict[str, Any],
         is_coordinator: bool, barrier: Callable[[], None]) -> None:
    """Write the checkpoint folder ``path`` (collective: every rank calls it).

    Args:
        path: the folder (e.g. ``.../last.ckpt``), the same on every rank.
        module: the LightningModule.
        optimizers: the dense torch optimizers.
        fused: every table's optimizer (TorchRec's fused one and the replicated tables' twins), or None.
        checkpoint: Lightning's checkpoint dict; its ``state_dict`` and ``optimizer_states`` are replaced by the
            sharded state, the rest goes to ``meta.pt``.
        is_coordinator: True on global rank 0.
        barrier: a barrier over all ranks.
    """
    metadata = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    save_sharded_checkpoint(path, sharded_state(module, optimizers, fused), metadata, is_coordinator, barrier)


def load(path: Path, module: nn.Module, optimizers: Sequence[Optimizer], fused: Any,
         weights_only: bool | None = None) -> dict[str, Any]:
    """Load this rank's share of ``path`` into the sharded module and its optimizers; return Lightning's metadata.

    Args:
        path: a folder :func:`save` wrote (under any world size and plan).
        module: the LightningModule, already sharded.
        optimizers: the dense torch optimizers (empty: weights only).
        fused: every table's optimizer (TorchRec's fused one and the replicated tables' twins), or None.
        weights_only: ``torch.load``'s for ``meta.pt``.

    Raises:
        FileNotFoundError: no such checkpoint.
        ValueError: not a DCP folder of this strategy (the message says what to do).
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    path = resolve_checkpoint(Path(path))
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist: check ckpt_path.")
    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"{str(path)!r} is not a DCP checkpoint folder: strategy=torchrec resumes from the folders it writes "
            "(tables are sharded; a single-file checkpoint holds one rank's view at best)."
        )
    # Lightning's metadata first: a refused meta.pt stops the load before any tensor is touched.
    metadata = load_plain(path / METADATA_FILE, weights_only=True if weights_only is None else weights_only)
    state = sharded_state(module, optimizers, fused)
    stored = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    # SGD tables have no state to find: only a table optimizer with state must find some.
    expects = TABLE_OPTIMIZER_KEY in state and any(state[TABLE_OPTIMIZER_KEY]["state"].values())
    if expects and not any(k.startswith(f"{TABLE_OPTIMIZER_KEY}.") for k in stored):
        raise ValueError(f"{str(path)!r} holds no table optimizer state: it was written without optimizers.")
    with refusals_unwrapped():  # a refused entry is a CheckpointRefused, not DCP's CheckpointException
        dcp_load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
    module.load_state_dict(state["state_dict"])
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(module, optimizer, optim_state_dict=state[f"optimizer_{index}"],
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))
    if TABLE_OPTIMIZER_KEY in state:
        fused.load_state_dict(state[TABLE_OPTIMIZER_KEY])
    return metadata
