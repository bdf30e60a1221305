"""``strategy="torchrec"``: embedding tables sharded by TorchRec, the dense part data-parallel.

:class:`TorchRecStrategy` hands the LightningModule to TorchRec's ``DistributedModelParallel`` (DMP): every
``EmbeddingBagCollection`` in it is replaced by its sharded twin according to a plan (TorchRec's planner,
constrained per table by ``sharding=``), and the rest of the module is wrapped in ``DistributedDataParallel``.
The plan is printed at start-up (table, type, ranks, MiB per rank). Lightning's loop is unchanged: the training
step runs through DMP, the dense optimizer is the module's ``configure_optimizers`` minus the tables, and the
tables are updated inside backward by TorchRec's fused optimizers -- or, for tables replicated with
``data_parallel`` (which TorchRec fuses nothing into), by a dense twin of the same optimizer with the same
hyper-parameters right after the dense step (:mod:`~lightning_parallel.strategies.torchrec.replicated`).

Note:
    * Order in :meth:`setup`: dense layers materialised and seeded first (they are plain modules; DDP inside DMP
      broadcasts nothing new then), tables given their optimizer, the plan agreed by all ranks, DMP built (tables
      allocated on ``meta`` -> only this rank's shards), then every shard filled with the plan-independent values
      of :func:`~lightning_parallel.adapters.torchrec.init_tables`. So 1, 2 or 4 processes and any plan start
      from the same numbers, and no rank ever holds a whole table it does not own.
    * Fused optimizers update a table in backward, once per backward: gradient accumulation would update it
      every micro-batch, so ``accumulate_grad_batches > 1`` is refused. Gradient clipping reaches the dense
      parameters only.
    * Refusals come before any table is built: torchrec missing (install command named) or a sharding type
      unknown in ``__init__``; a type this device/backend cannot run (row-wise on gloo) in
      :meth:`setup_environment`, before the process group starts; a replicated table whose optimizer has no
      exact dense twin (Adam, ...) in :meth:`setup`, once ``configure_model`` has given the tables optimizers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_parallel.adapters.torchrec import (
    EMBEDDING_OPTIMIZERS,
    apply_table_optimizer,
    embedding_collections,
    in_backward_parameters,
    init_tables,
    require_torchrec,
    table_configs,
    table_optimizers,
)
from lightning_parallel.protocol import layer_seed, owned_tensors, reset_parameters
from lightning_parallel.strategies.torchrec import checkpoint as torchrec_checkpoint
from lightning_parallel.strategies.torchrec.replicated import (
    ReplicatedTableOptimizer,
    TableOptimizers,
    check_replicated_optimizers,
)
from lightning_parallel.strategies.torchrec.sharding_plan import (
    Sharding,
    check_runnable,
    check_sharding_names,
    format_plan,
    plan_rows,
    plan_tables,
)


class TorchRecStrategy(DDPStrategy):
    """TorchRec's model parallelism for embedding tables inside Lightning; the dense part data-parallel.

    Args:
        sharding: None (TorchRec's planner chooses a sharded type per table), one type for every table, or
            ``{table name: type}`` with types among ``data_parallel``, ``table_wise``, ``column_wise``,
            ``table_column_wise`` (and the row-wise types where the backend runs them).
        column_shard_dim: width of column-wise shards; None leaves it to TorchRec (128 columns or the whole table).
        embedding_optimizer: the tables' fused optimizer when the module did not give them one
            (``sgd``, ``adagrad``, ``adam``, ``rowwise_adagrad``); None requires the module to.
        embedding_optimizer_kwargs: its arguments (``{"lr": 0.05}``).
        compute_kernel: TorchRec's kernel for sharded tables (``fused``: the optimizer runs in backward).
        **ddp_kwargs: besides Lightning's ``DDPStrategy`` arguments (``accelerator``, ``parallel_devices``,
            ``process_group_backend``, ``timeout``, ...), passed to the ``DistributedDataParallel`` that DMP wraps
            around the dense part.

    Raises:
        ImportError: torchrec or fbgemm-gpu is not installed (the message names the install command).
        ValueError: an unknown sharding type or embedding optimizer.
    """

    strategy_name = "torchrec"

    def __init__(
        self,
        sharding: Sharding = None,
        column_shard_dim: Optional[int] = None,
        embedding_optimizer: Optional[str] = None,
        embedding_optimizer_kwargs: Optional[Mapping[str, Any]] = None,
        compute_kernel: str = "fused",
        accelerator: Any = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = None,
        **ddp_kwargs: Any,
    ) -> None:
        require_torchrec()
        check_sharding_names(sharding)
        if embedding_optimizer is not None and embedding_optimizer not in EMBEDDING_OPTIMIZERS:
            raise ValueError(f"embedding_optimizer={embedding_optimizer!r} is not one of {list(EMBEDDING_OPTIMIZERS)}.")
        if column_shard_dim is not None and int(column_shard_dim) < 1:
            raise ValueError(f"column_shard_dim={column_shard_dim} must be a positive width, or None.")
        extra = {"timeout": timeout} if timeout is not None else {}
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend, **extra)
        self.sharding = dict(sharding) if isinstance(sharding, Mapping) else sharding
        self.column_shard_dim = None if column_shard_dim is None else int(column_shard_dim)
        self.embedding_optimizer = embedding_optimizer
        self.embedding_optimizer_kwargs = dict(embedding_optimizer_kwargs or {})
        self.compute_kernel = compute_kernel
        self.dmp_ddp_kwargs = {"static_graph": False, "find_unused_parameters": False, **ddp_kwargs}
        self.plan: Any = None
        self.plan_table: list = []
        self.dmp: Any = None  # TorchRec's DistributedModelParallel; kept after teardown unwraps self.model
        self.replicated_tables: Optional[ReplicatedTableOptimizer] = None  # twins of data-parallel tables' optimizers

    # --- lifecycle ---------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Refuse a sharding type this device and backend cannot run, then start the process group."""
        check_runnable(self.sharding, self.root_device.type, self._backend())
        super().setup_environment()

    def _backend(self) -> str:
        """The process group's backend: the one asked for, else Lightning's default for the device."""
        return self.process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Iterator[None]:
        """Modules created in ``configure_model`` are built on ``meta`` unless ``empty_init=False``: TorchRec then
        allocates only this rank's shards, and :meth:`setup` the dense layers."""
        if empty_init is False:
            with super().tensor_init_context(empty_init=False):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the tables, wrap the dense part in DDP, and set up the dense optimizers (see the module's Note)."""
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self.dmp is not None and self.dmp.module is module:  # fit, then validate/test with the same Trainer
            self.model = self.dmp
            if trainer.state.fn == TrainerFn.FITTING:
                self.setup_optimizers(trainer)
                self._drop_tables_from_optimizers(module)
            self.setup_precision_plugin()
            return
        if trainer.state.fn == TrainerFn.FITTING and trainer.accumulate_grad_batches > 1:
            raise ValueError(
                f"strategy=torchrec updates tables inside backward (fused optimizers): accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches} would update them every micro-batch. Use a larger batch instead."
            )
        if not embedding_collections(module):
            raise ValueError(
                f"{type(module).__name__} holds no torchrec EmbeddingBagCollection: strategy=torchrec shards those "
                "(see examples/recsys/torchrec_model.py); for other models use ddp or hybrid."
            )
        self.precision_plugin.convert_module(module)
        seed = int(self.broadcast(torch.initial_seed()))  # one seed on every rank, seeded or not
        self._materialize_dense(module, seed)
        apply_table_optimizer(module, self.embedding_optimizer, self.embedding_optimizer_kwargs)
        tables = table_configs(module)  # before sharding: the sharded collections are another type
        settings = table_optimizers(module, tables)  # before sharding: TorchRec rewrites them into fused params
        check_replicated_optimizers(settings, self._requested_replicated(tables))
        self.dmp = self._shard(module, tables, settings)
        self.model = self.dmp
        init_tables(module, seed, tables)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._drop_tables_from_optimizers(module)
        self.setup_precision_plugin()

    def _materialize_dense(self, module: nn.Module, seed: int) -> None:
        """Allocate and seed every module outside the collections that is still on ``meta`` (the suite's per-layer
        seeded values, as :func:`lightning_parallel.protocol.seeded_init` gives an eagerly built model)."""
        tables = tuple(embedding_collections(module))
        for name, owner in module.named_modules():
            if any(name == t or name.startswith(f"{t}.") for t in tables):
                continue
            owned = owned_tensors(owner)
            if not owned or not any(t.is_meta for _, t in owned):
                continue
            owner.to_empty(device=self.root_device, recurse=False)
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(layer_seed(seed, name))
                reset_parameters(name, owner)

    def _requested_replicated(self, tables: Mapping[str, Any]) -> list[str]:
        """The tables asked to be ``data_parallel`` (the planner replicates no other: see ``parameter_constraints``)."""
        wanted = dict.fromkeys(tables, self.sharding) if not isinstance(self.sharding, Mapping) else self.sharding
        return [table for table, kind in wanted.items() if kind == "data_parallel"]

    def _shard(self, module: nn.Module, tables: dict[str, tuple[str, Any]],
               settings: Mapping[str, tuple[type, dict[str, Any]]]) -> nn.Module:
        """Plan (collectively), wrap ``module`` in DMP, give replicated tables their optimizer's twin, and print
        the plan on rank 0."""
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel

        sharders = [EmbeddingBagCollectionSharder()]
        self.plan = plan_tables(module, tables, self.sharding, self.world_size, self.root_device.type, self._backend(),
                                self.compute_kernel, self.column_shard_dim, torch.distributed.group.WORLD)
        self.plan_table = plan_rows(self.plan, tables, self.world_size)
        ddp = dict(self.dmp_ddp_kwargs)
        wrapper = DefaultDataParallelWrapper(static_graph=ddp.pop("static_graph"),
                                             find_unused_parameters=ddp.pop("find_unused_parameters"), ddp_kwargs=ddp)
        dmp = DistributedModelParallel(module, device=self.root_device, plan=self.plan, sharders=sharders,
                                       data_parallel_wrapper=wrapper)
        replicated = {r.table: tables[r.table] for r in self.plan_table if r.sharding_type == "data_parallel"}
        self.replicated_tables = ReplicatedTableOptimizer(module, replicated, settings) if replicated else None
        note = (f"\nReplicated (data_parallel) tables keep their optimizer, stepped after the dense one: "
                f"{self.replicated_tables.describe()}" if self.replicated_tables else "")
        rank_zero_info(f"TorchRec sharding plan over {self.world_size} ranks:\n{format_plan(self.plan_table)}{note}")
        return dmp

    def _drop_tables_from_optimizers(self, module: nn.Module) -> None:
        """Take the tables' parameters out of the dense optimizers (their fused optimizers or twins own them).

        Note:
            Groups are emptied, never removed: a learning-rate scheduler keeps one entry per group.
        """
        tables = {id(p) for p in in_backward_parameters(module).values()}
        tables |= {id(p) for p in (self.replicated_tables.parameters() if self.replicated_tables else [])}
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in tables]

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The dense step (its closure runs forward and backward), then the replicated tables' twins: DDP has
        averaged their gradients by then, as TorchRec's fused kernels have already updated the sharded tables."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.replicated_tables is not None:
            self.replicated_tables.step()
        return output

    # --- checkpoints (DCP folders: lightning_parallel.strategies.torchrec.checkpoint) -----------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Load after :meth:`setup`: the checkpoint is read shard by shard into the plan of this run."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """False: :meth:`load_checkpoint` restores the dense and fused optimizer state itself."""
        return False

    def _torch_optimizers(self) -> list[Any]:
        return [o.optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]

    def _fused_optimizer(self) -> Any:
        """Every table's optimizer for checkpoints: TorchRec's fused one and the replicated tables' twins."""
        return None if self.dmp is None else TableOptimizers(self.dmp.fused_optimizer, self.replicated_tables)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write a DCP folder (every rank its shards) that appears under ``filepath`` when all ranks are done."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options (it writes with DCP).")
        path = Path(self.broadcast(str(filepath)))
        torchrec_checkpoint.save(path, self.lightning_module, self._torch_optimizers(), self._fused_optimizer(),
                                 checkpoint, self.global_rank == 0, self.barrier)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a DCP folder written under any world size and plan, resharded onto this one; the weights and the
        optimizer state are in place when it returns (Lightning's own loaders below then have nothing to do)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        return torchrec_checkpoint.load(path, self.lightning_module, self._torch_optimizers(),
                                        self._fused_optimizer(), weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the weights shard by shard."""

    def model_to_device(self) -> None:
        """Nothing to move: DMP places the shards and the dense layers on this rank's device in :meth:`setup`."""

    def teardown(self) -> None:
        self.model = self.lightning_module  # unwrap DMP; the module keeps its sharded collections
        module = self.lightning_module
        if module is not None and any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            # setup stopped before sharding (an error on the way): Lightning's teardown would try to move the meta
            # tensors to the CPU and raise over the error that matters; release the rest only.
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="TorchRec-sharded embedding tables, data-parallel dense part "
                "(lightning_parallel)"
            )
