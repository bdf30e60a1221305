"""A router's load-balancing loss is refused under a layout that would change it, never dropped or changed.

Mixtral with ``output_router_logits=True`` adds ``router_aux_loss_coef * load_balancing_loss`` to its loss;
the balancing loss is formed from the routing statistics of the tokens the forward sees, so pipeline and
context parallelism would each form it on part of the batch (and the pipeline's stages would drop it). Data
parallelism sums the statistics over the ranks first (``adapters/hf/router_loss.py``), and tensor parallelism
keeps the batch whole on every rank, so both are allowed.
"""

import lightning.pytorch as pl
import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_parallel.layout import ParallelLayout  # noqa: E402
from lightning_parallel.parallel.compose import check_module  # noqa: E402
from lightning_parallel.parallel.context_and_experts import batch_splits  # noqa: E402
from lightning_parallel.parallel.options import ParallelOptions  # noqa: E402


class MoELM(pl.LightningModule):
    def __init__(self, router_loss: bool) -> None:
        super().__init__()
        config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, output_router_logits=router_loss)
        with torch.device("meta"):
            self.model = transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("sizes", [dict(pipeline_parallel=2, data_parallel=1),
                                   dict(data_parallel=1, context_parallel=2)], ids=["pp2", "cp2"])
def test_router_loss_is_refused_where_the_batch_is_split(sizes):
    layout = ParallelLayout.resolve(2, **sizes)
    with pytest.raises(ValueError, match=r"output_router_logits=True.*Set output_router_logits=False") as error:
        check_module(MoELM(router_loss=True), layout, ParallelOptions(context_parallel_size=layout.context_parallel))
    assert batch_splits(layout)[0] in str(error.value)  # names the setting that splits the batch


def test_router_loss_is_allowed_whole_and_without_it_split():
    check_module(MoELM(router_loss=True), ParallelLayout.resolve(1), ParallelOptions())
    check_module(MoELM(router_loss=True), ParallelLayout.resolve(2, data_parallel=2), ParallelOptions())
    check_module(MoELM(router_loss=False), ParallelLayout.resolve(2, data_parallel=2), ParallelOptions())
