"""TorchRecStrategy without processes: its name, its refusals, plans and their bytes per rank, table init."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

from lightning_parallel.adapters.torchrec import INIT_BLOCK_ROWS, fill_table_region, require_torchrec  # noqa: E402
from lightning_parallel.strategies.torchrec.strategy import TorchRecStrategy  # noqa: E402
from lightning_parallel.strategies.torchrec.sharding_plan import (  # noqa: E402
    bytes_per_rank,
    check_runnable,
    format_plan,
    parameter_constraints,
    plan_rows,
    plan_sharding,
    runnable_sharding_types,
)

CONF = Path(__file__).resolve().parents[3] / "conf"


def _dlrm(table_sizes, embedding_dim=16):
    """The recipe's model with its layers built on ``meta`` (as under strategy=torchrec)."""
    from examples.recsys.torchrec_model import TorchRecDLRM

    model = TorchRecDLRM(table_sizes=table_sizes, embedding_dim=embedding_dim)
    with torch.device("meta"):
        model.configure_model()
    return model


def _plan(model, sharding, world_size, column_shard_dim=None):
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from lightning_parallel.adapters.torchrec import table_configs

    tables = table_configs(model)
    constraints = parameter_constraints(tables, sharding, runnable_sharding_types("cpu", "gloo"),
                                        column_shard_dim=column_shard_dim)
    plan = plan_sharding(model, [EmbeddingBagCollectionSharder()], constraints, world_size, "cpu")
    return plan_rows(plan, tables, world_size)


def test_registered_as_torchrec():
    from lightning.pytorch.strategies import StrategyRegistry

    TorchRecStrategy.register_strategies(StrategyRegistry)
    assert StrategyRegistry["torchrec"]["strategy"] is TorchRecStrategy


def test_gloo_runs_the_four_types_torchrec_tests_there_and_refuses_row_wise_naming_them():
    assert runnable_sharding_types("cpu", "gloo") == ["data_parallel", "table_wise", "column_wise", "table_column_wise"]
    with pytest.raises(ValueError, match=r"cannot shard .*row_wise.*reduce-scatter.*'table_wise', 'column_wise'"):
        check_runnable({"t_0": "row_wise"}, "cpu", "gloo")
    check_runnable({"t_0": "table_wise", "t_1": "column_wise"}, "cpu", "gloo")


def test_unknown_names_are_refused_in_the_constructor():
    with pytest.raises(ValueError, match="not TorchRec's"):
        TorchRecStrategy(sharding="by_rows")
    with pytest.raises(ValueError, match="embedding_optimizer"):
        TorchRecStrategy(embedding_optimizer="lamb")


def test_row_wise_is_refused_before_any_process_group_starts():
    import lightning.pytorch as pl

    model = _dlrm((100, 50))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=TorchRecStrategy(sharding="row_wise"), max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="Sharding types that run here"):
        trainer.fit(model, train_dataloaders=[])
    assert not torch.distributed.is_initialized()


def test_missing_torchrec_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchrec", None)  # `import torchrec` raises ImportError
    with pytest.raises(ImportError, match=r"lightning_parallel\[recsys\]"):
        require_torchrec()


def test_sharding_names_a_table_the_model_lacks():
    from lightning_parallel.adapters.torchrec import table_configs

    with pytest.raises(ValueError, match=r"tables \['t_9'\].*its tables: \['t_0', 't_1'\]"):
        parameter_constraints(table_configs(_dlrm((100, 50))), {"t_9": "table_wise"}, ["table_wise"])


def test_table_wise_on_four_ranks_holds_under_a_third_of_a_replica_for_dlrm_large():
    from omegaconf import OmegaConf

    conf = OmegaConf.load(CONF / "model" / "dlrm_large.yaml")
    model = _dlrm(list(conf.table_sizes), conf.embedding_dim)
    table_wise = bytes_per_rank(_plan(model, "table_wise", 4))
    replicated = bytes_per_rank(_plan(model, "data_parallel", 4))
    ratio = max(table_wise) / max(replicated)
    print(f"dlrm_large, 4 ranks: table-wise {[b / 2**20 for b in table_wise]} MiB vs replicated "
          f"{replicated[0] / 2**20} MiB per rank (ratio {ratio:.3f})")
    assert ratio <= 0.3
    assert sum(table_wise) == replicated[0]  # every table once, somewhere


def test_column_wise_splits_a_table_over_the_ranks_and_the_plan_prints():
    rows = _plan(_dlrm((1000, 64)), "column_wise", 2, column_shard_dim=8)
    assert [(r.table, r.sharding_type, r.ranks) for r in rows] == [("t_0", "column_wise", (0, 1)),
                                                                  ("t_1", "column_wise", (0, 1))]
    assert rows[0].bytes_per_rank == (1000 * 8 * 4, 1000 * 8 * 4)
    text = format_plan(rows)
    assert [c.strip() for c in text.splitlines()[0].split(" | ")] == ["table", "sharding type", "ranks", "rank 0 MiB",
                                                                      "rank 1 MiB"]
    assert "total" in text.splitlines()[-1]


def test_table_values_do_not_depend_on_how_the_table_is_cut():
    from torchrec import EmbeddingBagConfig

    config = EmbeddingBagConfig(name="t", embedding_dim=6, num_embeddings=INIT_BLOCK_ROWS + 100, feature_names=["f"])
    whole = torch.empty(config.num_embeddings, 6)
    fill_table_region(whole, config, seed=3, path="m", rows=(0, config.num_embeddings), columns=(0, 6))
    piece = torch.empty(200, 2)  # rows across the block boundary, a middle column shard
    fill_table_region(piece, config, seed=3, path="m", rows=(INIT_BLOCK_ROWS - 100, INIT_BLOCK_ROWS + 100),
                      columns=(2, 4))
    assert torch.equal(piece, whole[INIT_BLOCK_ROWS - 100:INIT_BLOCK_ROWS + 100, 2:4])
    bound = config.get_weight_init_max()
    assert whole.abs().max() <= bound and whole.std() > bound / 3  # TorchRec's default uniform(+-1/sqrt(rows))
    other = torch.empty_like(whole)
    fill_table_region(other, config, seed=4, path="m", rows=(0, config.num_embeddings), columns=(0, 6))
    assert not torch.equal(other, whole)
