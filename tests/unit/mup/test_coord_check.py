"""The coordinate check (lightning_parallel/mup/coord_check.py) on the GPT recipe: under μP the size of each block's
output, the logits and how far 5 AdamW steps move them stay flat from width 64 to 512; under the standard
parametrisation at the same learning rate they grow with the width.

The GPT recipe with 2 blocks, 4 heads, 16-byte windows of the standard-library text, batch 8, lr 3e-3, no weight
decay; base width 64. Measured after step 5: under μP width 512 over width 64 is 0.98-1.05 for every layer below and
the largest over the smallest of the four widths at most 1.32; under the standard parametrisation width 512 over width
64 is 4.6 (logits) to 46 (the first attention) (docs/scaling.md).
"""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from examples.nlp.data import ByteWindows, load_corpus
from examples.nlp.model import GPT
from lightning_parallel.mup.coord_check import coordinate_check, growth

WIDTHS, SEQ, BATCH, STEPS, LR = (64, 128, 256, 512), 16, 8, 5, 3e-3
LAYERS = ("blocks.0.attn", "blocks.0.mlp", "blocks.0", "blocks.1", "head")


def _batches():
    windows = ByteWindows(load_corpus(None, max_bytes=100_000, val_every=10)[0], SEQ)
    pairs = [[windows[step * BATCH + i * 37] for i in range(BATCH)] for step in range(STEPS)]
    return [tuple(torch.stack(column) for column in zip(*pair)) for pair in pairs]


def _build(width, base_width):
    model = GPT(seq_len=SEQ, d_model=width, n_layer=2, n_head=4, weight_decay=0.0, base_width=base_width,
                optimizer=partial(torch.optim.AdamW, lr=LR)).build()
    return model, model.configure_optimizers()["optimizer"]


def _loss(model, batch):
    inputs, targets = batch
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())


@pytest.fixture(scope="module")
def records():
    torch.set_num_threads(1)  # the shared machine's budget (and stable sums)
    batches = _batches()
    return {name: coordinate_check(partial(_build, base_width=base), WIDTHS, LAYERS, batches, _loss, batches[0][0])
            for name, base in (("mup", 64), ("standard", None))}


def _spread(records, quantity, layer):
    """Largest over smallest value across the widths, after the last step (1: flat)."""
    values = [getattr(records[w], quantity)[layer][-1] for w in WIDTHS]
    return max(values) / min(values)


@pytest.mark.parametrize("quantity", ["activation", "update"])
def test_mup_keeps_every_layers_coordinates_flat_from_width_64_to_512(records, quantity):
    spreads = {layer: _spread(records["mup"], quantity, layer) for layer in LAYERS}
    print(f"μP {quantity}, largest / smallest across widths:", {k: round(v, 3) for k, v in spreads.items()})
    assert max(spreads.values()) < 1.5, spreads


@pytest.mark.parametrize("quantity", ["activation", "update"])
def test_the_standard_parametrisation_grows_them_with_the_width(records, quantity):
    growths = {layer: growth(records["standard"], quantity, layer) for layer in LAYERS}
    print(f"standard {quantity}, width 512 / width 64:", {k: round(v, 2) for k, v in growths.items()})
    assert min(growths.values()) > 3.0, growths
    assert min(growth(records["standard"], quantity, layer) for layer in LAYERS if layer != "head") > 10.0


def test_both_start_from_the_same_model_at_the_base_width(records):
    # At width 64 = base_width every μP factor is 1: the same initial values, updates and losses.
    assert records["mup"][64].losses == records["standard"][64].losses
