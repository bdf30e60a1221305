"""What holds before a model is built under DeepSpeed: its process-wide accelerator, and ZeRO-3's partitioned build.

Lightning calls the strategy's ``setup_environment``, then the module's ``configure_model`` inside
``strategy.model_sharded_context()``, then ``strategy.setup`` (``deepspeed.initialize``).

- ``setup_environment`` points DeepSpeed's accelerator at the device Lightning trains on
  (:func:`use_deepspeed_accelerator`), so everything after it -- ``zero.Init`` included -- allocates
  there and talks gloo on CPU, NCCL on CUDA.
- Under ZeRO-3, ``model_sharded_context`` (Lightning's ``DeepSpeedStrategy``'s, which
  :class:`~lightning_parallel.strategies.deepspeed.strategy.DeepSpeedDataParallelStrategy` keeps) enters
  ``deepspeed.zero.Init(config_dict_or_path=strategy.config)``. Each module's ``__init__`` runs at full size,
  so its ``reset_parameters`` draws from the random stream exactly as without it; zero.Init then
  broadcasts rank 0's values and keeps this rank's partition. No rank holds more than one module in full,
  and the initial weights are rank 0's plain construction (``tests/distributed/test_deepspeed_zero3_init.py``).

Note:
    zero.Init bounds what construction holds (the share plus one module), not what ``deepspeed.initialize``
    allocates: its ZeRO-3 optimizer keeps the parameter partition, an fp32 copy, a flat gradient partition
    and, transiently, a flattened copy -- about four times the share, at least the whole model on 2-4 ranks,
    where the set-up peak was measured the same with or without zero.Init (CPU). Initialising parameters
    again after construction works through ``Module.apply`` (zero.Init gathers for it) or under
    ``deepspeed.zero.GatheredParameters(..., modifier_rank=0)``: a partitioned parameter holds no data of its own.
"""

from __future__ import annotations


def use_deepspeed_accelerator(device_type: str) -> None:
    """Make DeepSpeed's process-wide accelerator match Lightning's device type.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``, the device Lightning trains on.

    Raises:
        ValueError: Lightning trains on CUDA while ``DS_ACCELERATOR`` pins DeepSpeed to another device.

    Note:
        DeepSpeed picks its accelerator once per process (CUDA when it sees a GPU). A CPU
        run on a machine with a GPU must switch it to CPU before the model is built (``zero.Init``
        allocates on it) and before the engine is, or DeepSpeed would place tensors on CUDA and
        talk NCCL. It is DeepSpeed's own global; setting it to the device this process trains on is
        the only safe value.
    """
    from deepspeed.accelerator import get_accelerator, set_accelerator

    current = get_accelerator()
    if device_type == "cpu" and current.device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    elif device_type == "cuda" and current.device_name() != "cuda":
        raise ValueError(
            f"Lightning trains on CUDA but DeepSpeed's accelerator is {current.device_name()!r}: "
            "unset DS_ACCELERATOR (or set DS_ACCELERATOR=cuda)."
        )
