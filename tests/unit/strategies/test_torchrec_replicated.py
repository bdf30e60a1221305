"""Dense twins of TorchRec's fused table optimizers, without processes: which exist, with which arguments, and
what is refused (issue 39). That they update a replicated table as the fused kernel does is measured in
``tests/distributed/strategies/test_torchrec_replicated.py``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

from torchrec.optim import RowWiseAdagrad  # noqa: E402

from lightning_parallel.strategies.torchrec.replicated import (  # noqa: E402
    check_replicated_optimizers,
    dense_twin,
)


def test_sgd_and_adagrad_get_their_torch_twins_with_fbgemm_defaults():
    import torchrec.optim as trec

    assert dense_twin("t", torch.optim.SGD, {"lr": 0.5}) == (torch.optim.SGD, {"lr": 0.5})
    # fbgemm's eps (1e-8), not torch's Adagrad default (1e-10): the fused kernel's arithmetic.
    assert dense_twin("t", torch.optim.Adagrad, {"lr": 0.05}) == (torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-8})
    assert dense_twin("t", torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-6})[1]["eps"] == 1e-6
    assert dense_twin("t", RowWiseAdagrad, {"lr": 0.1}) == (RowWiseAdagrad, {"lr": 0.1, "eps": 1e-8})
    assert dense_twin("t", trec.Adagrad, {})[0] is torch.optim.Adagrad  # TorchRec's placeholder class
    assert dense_twin("t", trec.SGD, {})[1] == {"lr": 0.01}  # fbgemm's default learning rate


def test_kwargs_torchrec_rewrote_after_sharding_are_still_understood():
    """TorchRec writes ``optimizer`` and renames ``lr`` to ``learning_rate`` in the parameter's own kwargs."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    kwargs = {"learning_rate": 0.05, "optimizer": EmbOptimType.EXACT_ADAGRAD}
    assert dense_twin("t", torch.optim.Adagrad, kwargs) == (torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-8})


@pytest.mark.parametrize("optimizer, kwargs, reason", [
    (torch.optim.Adam, {"lr": 1e-3}, "fused Adam moves only the rows a batch touches"),
    (torch.optim.Adagrad, {"lr": 0.05, "weight_decay": 0.01}, r"arguments \['weight_decay'\]"),
    (torch.optim.RMSprop, {"lr": 0.05}, "no dense twin"),
])
def test_optimizers_without_an_exact_twin_are_refused_with_the_fix(optimizer, kwargs, reason):
    with pytest.raises(ValueError, match=reason) as refused:
        check_replicated_optimizers({"t_1": (optimizer, kwargs)}, ["t_1"])
    assert "sharding={'t_1': 'table_wise'}" in str(refused.value)
    check_replicated_optimizers({"t_1": (optimizer, kwargs)}, [])  # sharded tables keep any fused optimizer
