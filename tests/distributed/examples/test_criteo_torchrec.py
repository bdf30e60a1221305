"""``experiment=recsys_criteo``'s data: a Criteo-format TSV the test writes, read in chunks into ``KeyedJaggedTensor``
batches, trains TorchRec's DLRM table-wise and column-wise on 2 processes with one process's losses on every rank.

The file: 640 lines of label, 13 integers and 26 hex categories, about a fifth of each missing (empty bags), the
label planted on two categories and one integer so there is something to learn. fp32, Adagrad tables fused into
TorchRec's kernels, Adam on the MLPs, 8 steps of 64 lines (shuffled by the resumable loader: the same global batches
at every size). Negative control: the one-process run on the file read with every category present (missing ones
hashed as 0): the losses move, so the comparison sees the bags.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

from lightning_parallel.testing import max_abs_difference, run_processes  # noqa: E402

TOL, CONTROL_GAP = 1e-5, 1e-4
STEPS, GLOBAL_BATCH, LINES = 8, 64, 640
TABLE_SIZES = [97, 50, 31, 64] * 6 + [16, 8]  # 26 tables


def write_criteo(path: Path, lines: int = LINES, seed: int = 0, missing: float = 0.2) -> Path:
    """A Criteo-format TSV: the label is planted on categories 0 and 1 and integer 0."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(lines):
            ints = [rng.randrange(0, 1000) if rng.random() > missing else None for _ in range(13)]
            cats = [rng.randrange(0, 2**32) if rng.random() > missing else None for _ in range(26)]
            score = (cats[0] or 0) % 3 + (cats[1] or 0) % 2 + (ints[0] or 0) / 500
            label = int(score + rng.random() > 2.5)
            fields = [str(label), *("" if v is None else str(v) for v in ints),
                      *("" if v is None else f"{v:08x}" for v in cats)]
            handle.write("\t".join(fields) + "\n")
    return path


def fit_criteo(rank: int, world_size: int, path: str, cases: dict[str, dict]) -> dict[str, list[float]]:
    """Fit the TorchRec DLRM on the TSV for each case; its global-batch losses."""
    import lightning.pytorch as pl

    from examples.recsys.criteo import CriteoClickDataModule
    from examples.recsys.torchrec_model import TorchRecDLRM
    from lightning_parallel.strategies.torchrec.strategy import TorchRecStrategy
    from lightning_parallel.testing.fit import quiet_trainer
    from lightning_parallel.testing.parity import LossHistory

    results = {}
    for name, case in cases.items():
        pl.seed_everything(0)
        model = TorchRecDLRM(num_dense=13, table_sizes=TABLE_SIZES, embedding_dim=8, bottom_widths=(16,),
                             top_widths=(16,))
        data = CriteoClickDataModule(case.get("path", path), TABLE_SIZES, val_fraction=0.1, chunk_rows=100,
                                     batch_size=GLOBAL_BATCH // world_size)
        history = LossHistory()
        strategy = TorchRecStrategy(sharding=case["sharding"], column_shard_dim=case.get("column_shard_dim"))
        trainer = quiet_trainer(world_size, strategy, STEPS, [history], limit_val_batches=0)
        trainer.fit(model, datamodule=data)
        results[name] = {"losses": history.losses, "types": sorted({r.sharding_type for r in strategy.plan_table})}
    return results


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("criteo")
    path = write_criteo(root / "day_0.tsv")
    # The control: the same lines with every missing category written as 0 (a bag of one id, not an empty one).
    filled = root / "filled.tsv"
    filled.write_text("".join("\t".join(f if i < 14 or f else "0" for i, f in enumerate(line.split("\t"))) + "\n"
                              for line in path.read_text().splitlines()))
    return {"path": str(path), "filled": str(filled)}


@pytest.mark.slow
def test_criteo_tsv_trains_table_and_column_wise_as_one_process(files):
    reference_cases = {"one_process": {"sharding": "table_wise"},
                       "control/filled": {"sharding": "table_wise", "path": files["filled"]}}
    reference = run_processes(fit_criteo, 1, files["path"], reference_cases, timeout=600)[0]
    cases = {"table_wise": {"sharding": "table_wise"},
             "column_wise": {"sharding": "column_wise", "column_shard_dim": 4}}
    per_rank = run_processes(fit_criteo, 2, files["path"], cases, timeout=600)
    expected = reference["one_process"]["losses"]
    assert len(expected) == STEPS
    for rank, results in enumerate(per_rank):
        for name in cases:
            assert results[name]["types"] == [name]
            diff = max_abs_difference(results[name]["losses"], expected)
            print(f"{name} rank {rank}: max |loss - one process| {diff:.2e}")
            assert diff < TOL, f"{name} rank {rank}: {diff:.2e}"
    moved = max_abs_difference(reference["control/filled"]["losses"], expected)
    print(f"control: missing categories as id 0 instead of empty bags moves the losses by {moved:.2e}")
    assert moved > CONTROL_GAP
