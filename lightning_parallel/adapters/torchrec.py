"""What the suite needs to know about a model holding TorchRec ``EmbeddingBagCollection`` s.

The tables are found by type (TorchRec's own convention: its sharders wrap every ``EmbeddingBagCollection``
of the model and leave the model's code unchanged), initialised the same way under every sharding plan, and
given their fused optimizer. The Lightning side is :mod:`lightning_parallel.strategies.torchrec.strategy`.

Note:
    * TorchRec is optional (``pip install 'lightning_parallel[recsys]'``, then torchrec itself without its
      dependencies: its wheel asks for the CUDA ``fbgemm-gpu`` and pins an old torchmetrics). Importing this
      module does not import torchrec; every function that needs it imports it through :func:`require_torchrec`.
    * Initial values are a function of (seed, table path, block of rows) only: each block of
      :data:`INIT_BLOCK_ROWS` full rows is drawn from its own generator and a shard copies the rows and columns
      it holds. So table-wise, column-wise or data-parallel shards on any number of ranks, and the whole table
      of one process, hold the same numbers, and no rank ever draws more than one block it does not keep.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lightning_parallel._compat import in_backward_optimizer_settings
from lightning_parallel.protocol import layer_seed

#: Rows drawn per generator when a table is initialised; part of the values' definition (changing it changes them).
INIT_BLOCK_ROWS = 4096

INSTALL_HINT = (
    "pip install 'lightning_parallel[recsys]' && pip install --no-deps torchrec==1.8.0 "
    "(torchrec without its dependencies: its wheel asks for the CUDA fbgemm-gpu; the extra brings fbgemm-gpu-cpu)"
)

#: Optimizers a table can be given by name (``embedding_optimizer=``); TorchRec fuses them into its kernels.
EMBEDDING_OPTIMIZERS = ("sgd", "adagrad", "adam", "rowwise_adagrad")


def torchrec_available() -> bool:
    """Whether ``torchrec`` and ``fbgemm_gpu`` can be imported (checked without importing them)."""
    return all(importlib.util.find_spec(name) is not None for name in ("torchrec", "fbgemm_gpu"))


def require_torchrec() -> None:
    """Import torchrec (and its native ``fbgemm_gpu``) or raise with the install command.

    Raises:
        ImportError: either package is missing or its native library does not load.
    """
    try:
        import fbgemm_gpu  # noqa: F401  # the native kernels; a mismatch with torch fails here
        import torchrec  # noqa: F401
    except (ImportError, OSError) as error:
        raise ImportError(f"strategy=torchrec needs TorchRec and fbgemm-gpu: {INSTALL_HINT}. ({error})") from error


def embedding_collections(module: nn.Module) -> dict[str, nn.Module]:
    """The ``EmbeddingBagCollection`` s of ``module`` by their path, outermost first (none nested in another).

    Args:
        module: the LightningModule (or any module).
    """
    from torchrec import EmbeddingBagCollection

    found: dict[str, nn.Module] = {}
    for name, child in module.named_modules():
        if isinstance(child, EmbeddingBagCollection) and not any(name.startswith(f"{p}.") for p in found):
            found[name] = child
    return found


def table_configs(module: nn.Module) -> dict[str, tuple[str, Any]]:
    """``{table name: (path of its collection, its EmbeddingBagConfig)}`` over every collection of ``module``.

    Raises:
        ValueError: two collections hold tables of the same name (plans and checkpoints name tables alone).
    """
    tables: dict[str, tuple[str, Any]] = {}
    for path, collection in embedding_collections(module).items():
        for config in collection.embedding_bag_configs():
            if config.name in tables:
                raise ValueError(
                    f"Table {config.name!r} is in both {tables[config.name][0]!r} and {path!r}: give the tables "
                    "unique names (a sharding plan refers to a table by its name alone)."
                )
            tables[config.name] = (path, config)
    return tables


def table_bytes(config: Any) -> int:
    """Bytes of one whole table's weights (rows x width x element size)."""
    from torchrec.types import DataType

    element = {DataType.FP32: 4, DataType.FP16: 2, DataType.BF16: 2}.get(config.data_type, 4)
    return int(config.num_embeddings) * int(config.embedding_dim) * element


def _table_seed(seed: int, path: str, table: str, block: int) -> int:
    return layer_seed(seed, f"{path}.{table}:{block}" if path else f"{table}:{block}")


def _init_fn(config: Any) -> Callable[[Tensor], Any]:
    if config.init_fn is not None:
        return config.init_fn
    low, high = config.get_weight_init_min(), config.get_weight_init_max()  # TorchRec's default: +-1/sqrt(rows)
    return lambda block: torch.nn.init.uniform_(block, low, high)


@torch.no_grad()
def fill_table_region(target: Tensor, config: Any, seed: int, path: str, rows: tuple[int, int],
                      columns: tuple[int, int]) -> None:
    """Fill ``target`` with rows ``rows`` and columns ``columns`` of the table's seeded initial values.

    Args:
        target: the region's storage, shape ``(rows[1] - rows[0], columns[1] - columns[0])``.
        config: the table's ``EmbeddingBagConfig`` (its ``init_fn``, else uniform in TorchRec's default bounds).
        seed: the run's seed (the same on every rank).
        path: the collection's path in the model.
        rows: ``[first, end)`` rows of the table that ``target`` holds.
        columns: ``[first, end)`` columns of the table that ``target`` holds.
    """
    init = _init_fn(config)
    first_block, last_block = rows[0] // INIT_BLOCK_ROWS, max(rows[0], rows[1] - 1) // INIT_BLOCK_ROWS
    for block in range(first_block, last_block + 1):
        start = block * INIT_BLOCK_ROWS
        end = min(start + INIT_BLOCK_ROWS, int(config.num_embeddings))
        values = torch.empty(end - start, int(config.embedding_dim), dtype=torch.float32)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_table_seed(seed, path, config.name, block))
            init(values)
        lo, hi = max(start, rows[0]), min(end, rows[1])
        if lo < hi:
            region = values[lo - start:hi - start, columns[0]:columns[1]]
            target[lo - rows[0]:hi - rows[0]].copy_(region.to(target.dtype))


def _local_regions(value: Any) -> Iterator[tuple[Tensor, tuple[int, int], tuple[int, int]]]:
    """``(storage, rows, columns)`` of each piece of one table this rank holds: a ShardedTensor's local shards
    (recognised by ``local_shards()``; its class lives in a private torch module), or a whole plain tensor."""
    if callable(getattr(value, "local_shards", None)):
        for shard in value.local_shards():
            (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            yield shard.tensor, (r0, r0 + nr), (c0, c0 + nc)
    elif isinstance(value, Tensor):
        yield value, (0, value.shape[0]), (0, value.shape[1])
    else:
        raise TypeError(f"Unexpected table state of type {type(value).__name__}.")


def init_tables(module: nn.Module, seed: int, tables: dict[str, tuple[str, Any]] | None = None) -> int:
    """Give every table of ``module``'s collections -- whole or sharded -- its seeded initial values.

    Works on an unsharded model (a recipe built with storage) and on one sharded by TorchRec (each rank fills
    the shards it holds, found in the collection's ``state_dict``, which views the fused kernels' storage).

    Args:
        module: the model holding the collections.
        seed: the run's seed (the same on every rank).
        tables: :func:`table_configs` of the model before it was sharded (a sharded collection is another type);
            None reads them from ``module`` (unsharded).

    Returns:
        The number of elements this rank filled.
    """
    filled = 0
    for name, (path, config) in (table_configs(module) if tables is None else tables).items():
        collection = module.get_submodule(path) if path else module
        state = collection.state_dict()
        key = f"embedding_bags.{name}.weight"
        if key not in state:
            raise KeyError(f"Table {name!r} has no {key!r} in the state of {path!r}: an unknown TorchRec layout.")
        for storage, rows, columns in _local_regions(state[key]):
            fill_table_region(storage, config, seed, path, rows, columns)
            filled += storage.numel()
    return filled


def optimizer_class(name: str) -> type:
    """The optimizer class TorchRec fuses for ``name`` (:data:`EMBEDDING_OPTIMIZERS`).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name == "rowwise_adagrad":
        from torchrec.optim import RowWiseAdagrad

        return RowWiseAdagrad
    classes = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}
    if name not in classes:
        raise ValueError(f"embedding_optimizer={name!r} is not one of {list(EMBEDDING_OPTIMIZERS)}.")
    return classes[name]


def in_backward_parameters(module: nn.Module) -> dict[str, Tensor]:
    """``{name: parameter}`` of the parameters of ``module`` that an optimizer updates inside backward (TorchRec's
    fused table optimizers, torch's ``_apply_optimizer_in_backward``): the ones a dense optimizer must leave alone."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    return dict(in_backward_optimizer_filter(module.named_parameters(), include=True))


def table_optimizers(module: nn.Module, tables: dict[str, tuple[str, Any]] | None = None
                     ) -> dict[str, tuple[type, dict[str, Any]]]:
    """``{table name: (optimizer class, kwargs)}``: the optimizer in backward each table of ``module`` was given
    (the class and arguments TorchRec's sharders fuse into its kernel); tables without one are left out.

    Args:
        module: the model holding the collections, still unsharded (a sharded table's parameter is another one).
        tables: :func:`table_configs` of ``module``; None reads them.
    """
    found = {}
    for name, (path, _) in (table_configs(module) if tables is None else tables).items():
        collection = module.get_submodule(path) if path else module
        settings = in_backward_optimizer_settings(collection.embedding_bags[name].weight)
        if settings is not None:
            found[name] = settings
    return found


def apply_table_optimizer(module: nn.Module, name: str | None, kwargs: dict[str, Any]) -> list[str]:
    """Give every table without an optimizer in backward the optimizer ``name`` with ``kwargs``.

    Args:
        module: the model holding the collections (still unsharded).
        name: one of :data:`EMBEDDING_OPTIMIZERS`, or None to require the model to have set them.
        kwargs: the optimizer's arguments (``lr``, ``eps``, ...).

    Returns:
        The names of the tables' parameters it gave an optimizer.

    Raises:
        ValueError: ``name`` is None and a table has no optimizer (the message says both ways to give one).
    """
    import warnings

    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    missing: dict[str, Tensor] = {}
    for path, collection in embedding_collections(module).items():
        done = set(in_backward_parameters(collection))
        missing.update({f"{path}.{n}" if path else n: p for n, p in collection.named_parameters() if n not in done})
    if missing and name is None:
        raise ValueError(
            f"The tables {sorted(missing)} have no optimizer: TorchRec updates tables inside backward with a fused "
            "optimizer. Pass embedding_optimizer='sgd'|'adagrad'|'adam'|'rowwise_adagrad' (and "
            "embedding_optimizer_kwargs={'lr': ...}) to the strategy, or call torchrec's "
            "apply_optimizer_in_backward(...) on the tables in configure_model()."
        )
    if missing:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning)  # torchrec points at torch's private twin
            apply_optimizer_in_backward(optimizer_class(name), list(missing.values()), dict(kwargs))
    return sorted(missing)
