"""The GPT recipe's end-of-training readout: perplexity metric and a greedy text sample."""

import math

import pytest
import torch

from tests.distributed.parity_runs import tiny_gpt


def test_greedy_sample_uses_one_window_shape_and_extends_the_prompt():
    model = tiny_gpt().build().eval()
    shapes = []

    def predict(batch):
        shapes.append(tuple(batch[0].shape))
        return model(batch[0])

    out = model.evaluation_readout(predict, prompt="ab", new_tokens=5)
    assert set(shapes) == {(1, model.hparams.seq_len)} and len(shapes) == 5
    assert eval(out["sample"]).startswith("ab")


def test_padding_after_the_prompt_does_not_change_its_logits():
    model = tiny_gpt().build().eval()
    ids = torch.tensor([[5, 6, 7] + [0] * 13])
    other = torch.tensor([[5, 6, 7] + [9] * 13])
    torch.testing.assert_close(model(ids)[0, 2], model(other)[0, 2])


def test_perplexity_metric_is_exp_of_the_cross_entropy():
    model = tiny_gpt().build().eval()
    idx = torch.randint(0, 256, (2, 16))
    logits = model(idx)
    metric = model.evaluation_metrics()["perplexity"]
    metric.update(logits, idx)
    loss = model.pipeline_loss(logits, idx)
    assert float(metric.compute()) == pytest.approx(math.exp(loss.item()), rel=1e-4)
