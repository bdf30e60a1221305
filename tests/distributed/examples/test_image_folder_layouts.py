"""``data=image_folder``: the ViT on an image folder the test writes trains under data 2, pipeline 2 and data 2 with
two decoding workers per rank with one process's losses on every rank (augmentation on: each image's crop and flip
are seeded by image and epoch, so every layout and worker draws the same).

The folder: 3 classes x 24 PNGs of unequal sizes (20-43 x 28 pixels, the class in one colour channel), read at 16x16;
the ViT of the recipe (width 16, 2 layers, patches of 2). fp32, AdamW, 8 steps of 16 images (two epochs: the second
epoch's crops differ from the first's). Negative control: augmentation drawn from each process's own generator
(what a loader with ``torch.rand`` in a transform does): the data-parallel losses move.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from lightning_parallel.testing import max_abs_difference, run_processes

pytestmark = pytest.mark.slow

TOL, CONTROL_GAP = 1e-5, 1e-4
STEPS, GLOBAL_BATCH, CLASSES, PER_CLASS = 8, 16, 3, 24


def write_image_folder(root: Path, classes: int = CLASSES, per_class: int = PER_CLASS, seed: int = 0) -> Path:
    """``root/class<c>/<i>.png``: noise with class ``c``'s colour channel raised, heights 20 to 20 + per_class - 1."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = (rng.random((20 + i, 28, 3)) * 80).astype(np.uint8)
            pixels[..., c % 3] += 150
            Image.fromarray(pixels).save(root / f"class{c}" / f"{i}.png")
    return root


def fit_image_folder(rank: int, world_size: int, path: str, cases: dict[str, dict]) -> dict[str, list[float]]:
    """Fit the recipe's ViT on the folder for each case; its global-batch losses."""
    import lightning.pytorch as pl
    import numpy as np

    from examples.vision import image_folder
    from examples.vision.model import ViT
    from lightning_parallel.strategies import HybridParallelStrategy
    from lightning_parallel.testing.fit import quiet_trainer
    from lightning_parallel.testing.parity import LossHistory

    results = {}
    for name, case in cases.items():
        pl.seed_everything(0)
        torch.manual_seed(0)
        model = ViT(image_size=16, patch_size=2, in_channels=3, num_classes=CLASSES, d_model=16, n_layer=2, n_head=2,
                    mlp_ratio=2, warmup_steps=0, optimizer=partial(torch.optim.AdamW, lr=3e-3))
        sizes = case["sizes"]
        data = image_folder.ImageFolderDataModule(path, image_size=16, num_classes=CLASSES, val_fraction=0.25,
                                                  batch_size=GLOBAL_BATCH // sizes.get("data", 1),
                                                  num_workers=case.get("workers", 0))
        if case.get("control"):  # each process draws its own augmentation (not seeded by image and epoch)
            own = np.random.default_rng(1000 + rank)
            data.setup()
            draw = image_folder.random_resized_crop
            image_folder.random_resized_crop = lambda image, size, rng, scale: draw(image, size, own, scale)
        history = LossHistory()
        strategy = HybridParallelStrategy(**{f"{axis}_parallel_size": n for axis, n in sizes.items()},
                                          microbatches=case.get("microbatches", 1))
        trainer = quiet_trainer(world_size, strategy, STEPS, [history], limit_val_batches=0)
        try:
            trainer.fit(model, datamodule=data)
        finally:
            if case.get("control"):
                image_folder.random_resized_crop = draw
        results[name] = history.losses
    return results


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(write_image_folder(tmp_path_factory.mktemp("images")))


ALL_CASES = {
    "dp2": {"sizes": {"data": 2, "pipeline": 1, "tensor": 1}},
    "pp2": {"sizes": {"data": 1, "pipeline": 2, "tensor": 1}, "microbatches": 2},
    "dp2/2 workers": {"sizes": {"data": 2, "pipeline": 1, "tensor": 1}, "workers": 2},
    "control/dp2": {"sizes": {"data": 2, "pipeline": 1, "tensor": 1}, "control": True},
}


# By default data 2 and its control (the suite's time budget: all four took 100 s); the pipeline and the loader
# workers with -m extended.
@pytest.mark.parametrize("names", [pytest.param(("dp2", "control/dp2"), id="data"),
                                   pytest.param(tuple(ALL_CASES), id="all", marks=pytest.mark.extended)])
def test_image_folder_trains_under_data_and_pipeline_as_one_process(folder, names):
    one = {"sizes": {"data": 1, "pipeline": 1, "tensor": 1}}
    reference = run_processes(fit_image_folder, 1, folder, {"one_process": one}, timeout=600)[0]["one_process"]
    cases = {name: ALL_CASES[name] for name in names}
    per_rank = run_processes(fit_image_folder, 2, folder, cases, timeout=900)
    assert len(reference) == STEPS and reference[-1] < reference[0]
    for rank, results in enumerate(per_rank):
        for name, losses in results.items():
            diff = max_abs_difference(losses, reference)
            print(f"{name} rank {rank}: max |loss - one process| {diff:.2e}")
            assert (diff > CONTROL_GAP) if name.startswith("control/") else (diff < TOL), f"{name} rank {rank}"
