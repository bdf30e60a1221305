"""FSDP2 roots of a Hugging Face model held by a LightningModule: after a zero-glue fit (``training_step`` calls
``self.model(**batch)``), the LightningModule's own forward still runs -- what ``predict_step`` and the evaluation
after ``lp-train`` call -- and gives the model's logits, under ZeRO 2 and 3."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="pip install -e '.[hf]'")

from lightning_parallel.adapters import adapt  # noqa: E402
from lightning_parallel.testing import run_processes  # noqa: E402
from tests.distributed.adapters.test_hf_padded_loss import PaddedLM, padded_samples  # noqa: E402

pytestmark = pytest.mark.slow


class WithForward(PaddedLM):
    """The padded Llama module with the forward a user writes for prediction."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def test_the_module_is_a_second_root_only_where_it_holds_parameters_of_its_own():
    module = WithForward()
    assert adapt(module).data_axis_roots() == [module.model]
    module.scale = nn.Parameter(torch.ones(()))  # a parameter outside the model: its unit is the module's
    assert adapt(module).data_axis_roots() == [module.model, module]


def _fit_then_forward(rank: int, world_size: int, zero_stage: int) -> dict:
    from torch.utils.data import DataLoader

    from lightning_parallel.strategies import HybridParallelStrategy
    from lightning_parallel.testing.fit import quiet_trainer

    module = WithForward()
    strategy = HybridParallelStrategy(data_parallel_size=2, zero_stage=zero_stage)
    trainer = quiet_trainer(world_size, strategy, 2, [], limit_val_batches=0)
    rows = padded_samples()
    trainer.fit(module, train_dataloaders=DataLoader(rows[rank::2][:8], batch_size=4))
    ids = torch.stack([r["input_ids"] for r in rows[:2]])
    with torch.no_grad():
        through_module = module(ids)  # FSDP2 failed here: "already been lazily initialized for model"
        through_model = module.model(input_ids=ids).logits
    return {"equal": torch.equal(through_module, through_model), "finite": bool(through_module.isfinite().all())}


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_the_modules_forward_runs_after_a_fit_that_called_only_the_model(zero_stage):
    results = run_processes(_fit_then_forward, 2, zero_stage, timeout=600)
    assert all(r["equal"] and r["finite"] for r in results), results
