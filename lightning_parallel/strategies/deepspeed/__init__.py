"""The DeepSpeed ZeRO 1-3 strategy's room: :mod:`.strategy` (Lightning's lifecycle over DeepSpeed's engine),
:mod:`.config` (the ZeRO configuration built from the options and the Trainer), :mod:`.construction` (the
accelerator and ZeRO-3's partitioned build before a model exists), :mod:`.steps` (the engine's backward and step).
"""

from lightning_parallel.strategies.deepspeed.strategy import REGISTERED, DeepSpeedDataParallelStrategy

__all__ = ["REGISTERED", "DeepSpeedDataParallelStrategy"]
