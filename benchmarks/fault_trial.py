"""The rank side of one fault-matrix trial: a tiny model under one layout, checkpointing every 2 steps, with the
suite's stop, non-finite and rank-record callbacks, and at most one :class:`FaultPoint` (see
:mod:`benchmarks.fault_matrix`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Optional

STEPS = 8  # optimizer steps of every run
SAVE_EVERY = 2  # a checkpoint after steps 2, 4, 6, 8 (an epoch is 4 batches: mid-epoch and epoch-end saves both)
GLOBAL_BATCH = 16
SAMPLES = 64


@dataclass(frozen=True)
class Layout:
    """One layout of the matrix.

    Args:
        name: the table's name.
        strategy: ``timeout -> strategy``.
        model: ``() -> LightningModule``.
        data: ``() -> dataset``.
        data_parallel: ranks that split the batch.
        world_size: processes.
        datamodule: ``per-rank batch size -> LightningDataModule``, for a model whose batches ``data`` cannot give.
    """

    name: str
    strategy: Callable[[timedelta], Any]
    model: Callable[[], Any]
    data: Callable[[], Any]
    data_parallel: int
    world_size: int = 2
    datamodule: Optional[Callable[[int], Any]] = None  # per-rank batch size -> a data module (instead of ``data``)


def _mlp() -> Any:
    from lightning_parallel.testing.models import ResidualMLP

    return ResidualMLP(optimizer="adamw")


def _regression() -> Any:
    from lightning_parallel.testing.models import regression_dataset

    return regression_dataset(SAMPLES, 32)


def _gpt(moe: bool = False) -> Any:
    import torch

    from examples.nlp.model import GPT

    torch.manual_seed(0)
    extra = {"moe": {"every": 2, "num_experts": 4, "top_k": 2, "aux_loss_weight": 0.05}} if moe else {}
    return GPT(seq_len=16, d_model=32, n_layer=2, n_head=4, optimizer=partial(torch.optim.AdamW, lr=1e-2),
               warmup_steps=0, **extra)


def _text() -> Any:
    from torch.utils.data import Subset

    from examples.nlp.data import ByteWindows, load_corpus

    train, _ = load_corpus(None, max_bytes=SAMPLES * 16 * 2, val_every=10)
    return Subset(ByteWindows(train, 16), range(SAMPLES))


def _hybrid(**sizes: Any) -> Callable[[timedelta], Any]:
    def build(timeout: timedelta) -> Any:
        from lightning_parallel.strategies import HybridParallelStrategy

        return HybridParallelStrategy(timeout=timeout, **sizes)

    return build


def _deepspeed(timeout: timedelta) -> Any:
    from lightning_parallel.strategies.deepspeed import DeepSpeedDataParallelStrategy

    return DeepSpeedDataParallelStrategy(zero_stage=2, timeout=timeout)


TABLE_SIZES = (1000, 500, 64, 32)


def _dlrm() -> Any:
    from examples.recsys.torchrec_model import TorchRecDLRM

    return TorchRecDLRM(table_sizes=TABLE_SIZES, embedding_dim=16, table_optimizer="adagrad", table_lr=0.05)


def _clicks(batch_size: int) -> Any:
    from examples.recsys.torchrec_data import ZipfClickDataModule

    return ZipfClickDataModule(table_sizes=TABLE_SIZES, train_samples=4 * GLOBAL_BATCH, val_samples=64,
                               batch_size=batch_size, shuffle=False)


def _torchrec(timeout: timedelta) -> Any:
    from lightning_parallel.strategies.torchrec.strategy import TorchRecStrategy

    return TorchRecStrategy(sharding="table_wise", timeout=timeout)


LAYOUTS = {layout.name: layout for layout in (
    Layout("data (DDP)", _hybrid(data_parallel_size=2), _mlp, _regression, 2),
    Layout("data (ZeRO-3)", _hybrid(data_parallel_size=2, zero_stage=3), _mlp, _regression, 2),
    Layout("pipeline", _hybrid(pipeline_parallel_size=2), _mlp, _regression, 1),
    Layout("tensor", _hybrid(tensor_parallel_size=2), _mlp, _regression, 1),
    Layout("context", _hybrid(context_parallel_size=2), _gpt, _text, 1),
    Layout("expert", _hybrid(data_parallel_size=2, expert_parallel_size=2), partial(_gpt, True), _text, 2),
    Layout("DeepSpeed ZeRO-2", _deepspeed, _mlp, _regression, 2),
    Layout("TorchRec (table-wise)", _torchrec, _dlrm, lambda: None, 2, datamodule=_clicks),
)}


def _callbacks(checkpoint_dir: str, point: Any) -> tuple[list[Any], Any, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_parallel.callbacks import ExactDataResume, NonFiniteGuard, RankRecorder
    from lightning_parallel.callbacks.graceful_stop import GracefulStop
    from lightning_parallel.testing import LossHistory
    from lightning_parallel.testing.fault_points import InjectFault

    history, stop = LossHistory(), GracefulStop(checkpoint_dir, agree_every_s=0)
    saver = ModelCheckpoint(dirpath=checkpoint_dir, filename="{step}", every_n_train_steps=SAVE_EVERY,
                            save_top_k=-1, save_last=True)
    injected = [InjectFault(point)] if point is not None else []
    return [RankRecorder(), *injected, stop, NonFiniteGuard("stop"), ExactDataResume(), saver, history], history, stop


def train_rank(rank: int, world_size: int, layout: str, checkpoint_dir: str, timeout_s: float,
               point: Optional[Any] = None, ckpt_path: Optional[str] = None) -> dict[str, Any]:
    """Rank function: fit ``layout`` for :data:`STEPS` steps (from ``ckpt_path`` if given) with ``point`` injected.

    Returns:
        ``losses`` (each trained batch's global loss), ``first_step`` (where the fit started), ``step`` (where it
        ended) and ``stopped_at`` (the step a SIGINT/SIGTERM stopped it after, or None).
    """
    import lightning.pytorch as pl

    from lightning_parallel.runtime import signals
    from lightning_parallel.testing.models import FixedOrderData

    signals.install()  # SIGINT/SIGTERM as under lp-train: GracefulStop agrees on a step and saves
    spec = LAYOUTS[layout]
    callbacks, history, stop = _callbacks(checkpoint_dir, point)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=spec.strategy(timedelta(seconds=timeout_s)),
                         max_steps=STEPS, limit_val_batches=0, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=callbacks)
    batch_size = GLOBAL_BATCH // spec.data_parallel
    data = spec.datamodule(batch_size) if spec.datamodule else FixedOrderData(spec.data(), batch_size=batch_size)
    first = {}
    trainer.fit(spec.model(), datamodule=data, ckpt_path=ckpt_path)
    first["step"] = trainer.global_step - len(history.losses)
    return {"losses": history.losses, "first_step": first["step"], "step": trainer.global_step,
            "stopped_at": stop.stopped_at}
