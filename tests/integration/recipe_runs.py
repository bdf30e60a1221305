"""Rank functions for the recipe tests: fit a tiny recipe under a strategy built from conf/strategy/.

Each case builds its strategy from the real Hydra file (``conf/strategy/<name>.yaml`` plus
overrides), the recipe's model at a fixed tiny size, and a fixed slice of the recipe's own
data served in a fixed order (:class:`FixedOrderData`), so a case's losses can be compared
with one process on the same global batches.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_parallel.testing.fit import fit_recording_losses

SAMPLES = 32  # 2 batches of 16, each seen 5 times in 10 steps: the loss falls reliably
TINY_TABLES = (64, 32, 8, 8, 8)  # users, items, segments, categories, hour: all divisible by 2 and 4


def compose_conf(overrides: list[str]) -> Any:
    """``conf/config.yaml`` composed with ``overrides``, as ``lp-train`` would."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lightning_parallel.cli.train import CONFIG_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, "paths.output_dir=/tmp/lp-recipe-runs"])
    GlobalHydra.instance().clear()
    return cfg


def strategy_from_conf(name: str, overrides: tuple[str, ...] = ()) -> Any:
    """The strategy ``conf/strategy/<name>.yaml`` instantiates (``"auto"`` for ``single``)."""
    from hydra.utils import instantiate

    cfg = compose_conf([f"strategy={name}", *overrides])
    return cfg.strategy if isinstance(cfg.strategy, str) else instantiate(cfg.strategy)


def tiny_model(recipe: str) -> pl.LightningModule:
    """The recipe's model at a fixed tiny size, same weights in every process."""
    torch.manual_seed(0)
    if recipe == "vit":
        from examples.vision.model import ViT

        return ViT(d_model=16, n_layer=2, n_head=2, mlp_ratio=2, optimizer=partial(torch.optim.AdamW, lr=3e-3))
    if recipe == "dlrm":
        from examples.recsys.model import DLRM

        return DLRM(num_dense=4, table_sizes=TINY_TABLES, embedding_dim=8, bottom_widths=(16,), top_widths=(16,),
                    optimizer=partial(torch.optim.AdamW, lr=1e-2))
    if recipe == "gpt":
        from tests.distributed.parity_runs import tiny_gpt

        return tiny_gpt()
    raise ValueError(f"unknown recipe {recipe!r}")



def tiny_dataset(recipe: str, samples: int = SAMPLES) -> Any:
    """A fixed slice of the recipe's own training data."""
    from torch.utils.data import Subset

    if recipe == "vit":
        from examples.vision.data import ImageDataModule

        data = ImageDataModule(max_shift=0)
        return Subset(data.train_dataset(augment=False), range(samples))
    if recipe == "dlrm":
        from examples.recsys.data import synthetic_click_log

        (log,) = synthetic_click_log([samples], TINY_TABLES, num_dense=4, seed=0)
        return log.dataset()
    if recipe == "gpt":
        from tests.distributed.parity_runs import text_dataset

        return text_dataset(samples, 16)
    raise ValueError(f"unknown recipe {recipe!r}")


def embedding_bytes(model: pl.LightningModule) -> tuple[int, int]:
    """(bytes of the embedding tables this rank stores, bytes of the full tables)."""
    from torch.distributed.tensor import DTensor

    local = full = 0
    for name, param in model.named_parameters():
        if name.startswith("embeddings."):
            shard = param.to_local() if isinstance(param, DTensor) else param
            local += shard.numel() * shard.element_size()
            full += param.numel() * param.element_size()  # a DTensor's numel is the global one
    return local, full


def fit_recipe(
    rank: int,
    world_size: int,
    recipe: str,
    strategy: str,
    overrides: tuple[str, ...] = (),
    global_batch: int = 16,
    data_parallel: int = 1,
    steps: int = 10,
) -> dict[str, Any]:
    """Fit a tiny recipe for ``steps`` steps; return its losses (or the error a layout raised).

    Args:
        rank: this process's rank.
        world_size: number of processes.
        recipe: ``vit``, ``dlrm`` or ``gpt``.
        strategy: a file of conf/strategy/ (``single`` for one process).
        overrides: Hydra overrides of the strategy (``strategy.pipeline_parallel_size=1``).
        global_batch: samples per step over all data-parallel ranks.
        data_parallel: data-parallel size of the layout.
        steps: optimizer steps.

    Returns:
        ``{"losses": [...], "embedding_bytes": (local, full)}``, or ``{"error": message}``
        when the strategy refused the model with a ``ValueError``.
    """
    pl.seed_everything(0)
    model = tiny_model(recipe)
    built, samples = strategy_from_conf(strategy, overrides), tiny_dataset(recipe)
    try:
        losses = fit_recording_losses(model, built, world_size, samples, global_batch // data_parallel, steps,
                                      limit_val_batches=0)
    except ValueError as error:
        return {"error": str(error)}
    return {"losses": losses, "embedding_bytes": embedding_bytes(model)}


def full_documents(samples: int = 16, seq_len: int = 16) -> Any:
    """Byte-level documents for the Hugging Face recipe, all ``seq_len`` long (no padding: every rank's
    token mean is the global one, so a data-parallel loss compares with one process exactly)."""
    from examples.nlp.hf_data import PaddedDocuments

    tokens = torch.randint(32, 127, (samples * seq_len,), generator=torch.Generator().manual_seed(0))
    return PaddedDocuments(tokens, seq_len=seq_len, vocab_size=128, min_length=seq_len)


def fit_pretrained(rank: int, world_size: int, folder: str, strategy: str, data_parallel: int = 1,
                   global_batch: int = 8, steps: int = 2) -> dict[str, Any]:
    """Fit the Hugging Face recipe (``model=hf_causal_lm``) with ``model.pretrained=folder`` and nothing else set
    for the weights, under ``conf/strategy/<strategy>.yaml``; return the losses (or the error).

    Returns:
        ``{"losses": [...], "vocab_size": the model's vocabulary}`` or ``{"error": message}``.
    """
    from hydra.utils import instantiate

    cfg = compose_conf(["model=hf_causal_lm", "data=text_padded", f"strategy={strategy}", f"model.pretrained={folder}",
                        "model.warmup_steps=0"])
    pl.seed_everything(0)
    model = instantiate(cfg.model)
    built = cfg.strategy if isinstance(cfg.strategy, str) else instantiate(cfg.strategy)
    try:
        losses = fit_recording_losses(model, built, world_size, full_documents(), global_batch // data_parallel,
                                      steps, limit_val_batches=0)
    except ValueError as error:
        return {"error": str(error)}
    return {"losses": losses, "vocab_size": model.model.config.vocab_size}


def fit_pretrained_cases(rank: int, world_size: int, folder: str, cases: dict[str, dict]) -> dict[str, dict]:
    """Several :func:`fit_pretrained` cases one after another in the same processes."""
    return {name: fit_pretrained(rank, world_size, folder, **kwargs) for name, kwargs in cases.items()}


def fit_recipe_cases(rank: int, world_size: int, cases: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """Run several :func:`fit_recipe` cases one after another in the same processes
    (spawning ranks costs seconds each on a small machine)."""
    return {name: fit_recipe(rank, world_size, **kwargs) for name, kwargs in cases.items()}


def reference_cases(cases: dict[str, dict]) -> dict[str, dict]:
    """The same cases on one process (``single``: Lightning's single-device strategy), deduplicated
    by recipe and steps: the reference does not depend on the layout."""
    out: dict[str, dict] = {}
    for kwargs in cases.values():
        out[reference_key(kwargs)] = {**kwargs, "strategy": "single", "overrides": (), "data_parallel": 1}
    return out


def reference_key(kwargs: dict) -> str:
    """The :func:`reference_cases` key of a case."""
    return f"{kwargs['recipe']}/{kwargs.get('global_batch', 16)}/{kwargs.get('steps', 10)}"


def falling(losses: list[float], window: int = 3) -> bool:
    """Whether the mean of the last ``window`` losses is below the mean of the first ``window``."""
    return sum(losses[-window:]) / window < sum(losses[:window]) / window


__all__ = [
    "compose_conf",
    "embedding_bytes",
    "falling",
    "fit_pretrained",
    "fit_pretrained_cases",
    "fit_recipe",
    "fit_recipe_cases",
    "full_documents",
    "reference_cases",
    "reference_key",
    "strategy_from_conf",
    "tiny_dataset",
    "tiny_model",
]

