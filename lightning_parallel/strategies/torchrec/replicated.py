"""Data-parallel (replicated) TorchRec tables keep the optimizer the model gave them.

TorchRec fuses a table's optimizer into the kernel of a *sharded* table only. A ``data_parallel`` table is a plain
dense parameter replicated with DDP (TorchRec's ``dense`` kernel), and TorchRec leaves it to whatever dense
optimizer the training loop has: under Lightning that was the module's ``configure_optimizers`` (the recipe's
Adam 1e-3 instead of its tables' Adagrad 0.05; held-out AUC 0.69 instead of 0.79), said once in the log.

:class:`ReplicatedTableOptimizer` gives each replicated table the dense twin of its fused optimizer -- the same
update rule with the same hyper-parameters, and fbgemm's defaults where the model gave none -- stepped after the
dense optimizer, once DDP has averaged the table's gradient. Twins exist only where the update is the same as the
fused one: fbgemm updates only the rows a batch touches, which equals a dense step over the whole table when an
untouched row (zero gradient) does not move (SGD, Adagrad, row-wise Adagrad, without weight decay). Anything else
(Adam's momentum moves untouched rows; LAMB, LARS, ...) is refused with the fix before any table is built.

Note:
    The twins' state is written in the fused optimizer's layout (``{parameter: {"<table>.momentum1": tensor}}``,
    the Adagrad sums), so a checkpoint moves between replicated and sharded tables, and between world sizes.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

#: Arguments a twin takes over (``learning_rate`` is TorchRec's spelling of ``lr`` once a table was sharded).
_TWIN_ARGUMENTS = ("lr", "learning_rate", "eps")


def _fbgemm_default(name: str) -> float:
    """fbgemm's default for a fused optimizer argument (what a sharded table uses when the model gave none)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    return float(inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__).parameters[name].default)


def _refusal(table: str, optimizer_class: type, kwargs: Mapping[str, Any], why: str) -> ValueError:
    return ValueError(
        f"Table {table!r} is data_parallel and its optimizer is {optimizer_class.__name__}({dict(kwargs)}): {why}. "
        "TorchRec fuses no optimizer into a replicated table, and no dense optimizer updates it the same way. Shard "
        f"that table instead (sharding={{{table!r}: 'table_wise'}} or 'column_wise'), or give the tables sgd, "
        "adagrad or rowwise_adagrad with lr (and eps) only."
    )


def dense_twin(table: str, optimizer_class: type, kwargs: Mapping[str, Any]) -> tuple[type, dict[str, Any]]:
    """The torch optimizer and arguments that update a replicated table as TorchRec's fused kernel would.

    Args:
        table: the table's name (for the message).
        optimizer_class: the class given to ``apply_optimizer_in_backward`` (``torch.optim.Adagrad``, TorchRec's
            placeholders such as ``torchrec.optim.Adagrad``, ``RowWiseAdagrad``, ...).
        kwargs: its arguments.

    Returns:
        ``(torch optimizer class, kwargs)``.

    Raises:
        ValueError: the fused update has no exact dense twin (the message names the fix).
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.utils import optimizer_type_to_emb_opt_type
    from torchrec.optim import RowWiseAdagrad

    twins = {EmbOptimType.EXACT_SGD: torch.optim.SGD, EmbOptimType.EXACT_ADAGRAD: torch.optim.Adagrad,
             EmbOptimType.EXACT_ROWWISE_ADAGRAD: RowWiseAdagrad}
    try:
        kind = optimizer_type_to_emb_opt_type(optimizer_class)
    except ValueError:
        kind = None
    if kind not in twins:
        why = ("fbgemm's fused Adam moves only the rows a batch touches, a dense Adam every row it ever saw (momentum)"
               if kind == EmbOptimType.ADAM else "TorchRec's exact sparse updates have no dense twin for it")
        raise _refusal(table, optimizer_class, kwargs, why)
    # TorchRec writes its fused type back into the kwargs once a table was sharded: that key is no argument.
    extra = sorted(k for k in kwargs if k not in _TWIN_ARGUMENTS and not (k == "optimizer" and kwargs[k] == kind))
    if extra:
        raise _refusal(table, optimizer_class, kwargs, f"the arguments {extra} change the sparse update")
    twin = twins[kind]
    arguments = {"lr": float(kwargs.get("lr", kwargs.get("learning_rate", _fbgemm_default("learning_rate"))))}
    if twin is not torch.optim.SGD:  # fbgemm's eps (1e-8), not torch's (1e-10), unless the model gave one
        arguments["eps"] = float(kwargs.get("eps", _fbgemm_default("eps")))
    return twin, arguments


def check_replicated_optimizers(settings: Mapping[str, tuple[type, dict[str, Any]]], replicated: list[str]) -> None:
    """Refuse, before any table is built, a replicated table whose optimizer has no dense twin.

    Args:
        settings: ``{table: (optimizer class, kwargs)}``
            (:func:`~lightning_parallel.adapters.torchrec.table_optimizers`).
        replicated: the tables asked to be ``data_parallel``.

    Raises:
        ValueError: see :func:`dense_twin`.
    """
    for table in replicated:
        if table in settings:
            dense_twin(table, *settings[table])


class ReplicatedTableOptimizer:
    """The dense twins of the fused optimizers of the replicated tables, one per table, stepped after backward.

    Args:
        module: the LightningModule, sharded by TorchRec.
        tables: ``{table name: (collection path, EmbeddingBagConfig)}`` of the replicated tables.
        settings: ``{table: (optimizer class, kwargs)}`` read before sharding.

    Attributes:
        optimizers: ``{parameter name: (table, torch optimizer)}``.
    """

    def __init__(self, module: nn.Module, tables: Mapping[str, tuple[str, Any]],
                 settings: Mapping[str, tuple[type, dict[str, Any]]]) -> None:
        named = dict(module.named_parameters())
        self.optimizers: dict[str, tuple[str, torch.optim.Optimizer]] = {}
        for table, (path, _) in tables.items():
            if table not in settings:
                raise ValueError(f"Table {table!r} has no optimizer: give it one (embedding_optimizer=...).")
            name = f"{path}.embedding_bags.{table}.weight" if path else f"embedding_bags.{table}.weight"
            twin, kwargs = dense_twin(table, *settings[table])
            # The parameter is TorchRec's per-table view of its flat weights; its .grad views the DDP-averaged one.
            self.optimizers[name] = (table, twin([named[name]], **kwargs))

    def parameters(self) -> list[Tensor]:
        """The replicated tables' parameters (which the dense optimizers must leave alone)."""
        return [p for _, optimizer in self.optimizers.values() for group in optimizer.param_groups
                for p in group["params"]]

    def describe(self) -> str:
        """``t_0: Adagrad(lr=0.05, eps=1e-08)``, one per table, for the start-up log."""
        rows = []
        for table, optimizer in self.optimizers.values():
            args = ", ".join(f"{k}={optimizer.defaults[k]}" for k in ("lr", "eps") if k in optimizer.defaults)
            rows.append(f"{table}: {type(optimizer).__name__}({args})")
        return "; ".join(rows)

    @torch.no_grad()
    def step(self) -> None:
        """Step every twin whose table got a gradient, then drop the gradients.

        Note:
            The tables of one group share one flat weight and gradient, which a table's ``grad = None`` clears
            for all: every twin steps first. Dropping them makes a second call in the same step a no-op (several
            dense optimizers) and keeps the next backward from accumulating onto this one.
        """
        for _, optimizer in self.optimizers.values():
            optimizer.step()
        for parameter in self.parameters():
            parameter.grad = None

    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        """``{parameter name: {"<table>.momentum1": state}}``: the fused optimizers' layout, as views of the twins'
        state (DCP loads into them in place). SGD has no state: ``{parameter name: {}}``."""
        from torchrec.optim import RowWiseAdagrad

        state: dict[str, dict[str, Tensor]] = {}
        for name, (table, optimizer) in self.optimizers.items():
            (parameter,) = optimizer.param_groups[0]["params"]
            sums = optimizer.state.get(parameter, {}).get("sum")
            if sums is None:  # SGD
                state[name] = {}
                continue
            # Row-wise Adagrad keeps one sum per row: (rows, 1) here, (rows,) in fbgemm.
            rowwise = isinstance(optimizer, RowWiseAdagrad)
            state[name] = {f"{table}.momentum1": sums.view(-1) if rowwise else sums}
        return state


class TableOptimizers:
    """TorchRec's fused optimizer and the replicated tables' twins as one ``state_dict`` for checkpoints.

    Args:
        fused: ``DistributedModelParallel.fused_optimizer`` (a ``KeyedOptimizer``).
        replicated: the twins, or None when no table is replicated.
    """

    def __init__(self, fused: Any, replicated: ReplicatedTableOptimizer | None) -> None:
        self.fused, self.replicated = fused, replicated

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {parameter name: {"<table>.momentum1": tensor}}}`` over every table."""
        state = dict(self.fused.state_dict()["state"])
        if self.replicated is not None:
            state.update(self.replicated.state_dict())
        return {"state": state}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the fused part; the twins' part was filled in place (its tensors are views of their state)."""
        own = self.fused.state_dict()["state"]
        self.fused.load_state_dict({"state": {k: v for k, v in state_dict["state"].items() if k in own}})
