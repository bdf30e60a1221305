"""What ``float8`` and ``float8_all_gather`` may be, checked before any process starts (no torchao import).

:class:`~lightning_parallel.parallel.options.ParallelOptions` calls :func:`check_float8_options` when it is built, so a
recipe name with a typo, a missing torchao or an FP8 all-gather torchao refuses fails in the launching process with the
fix named; :func:`check_float8_device` runs once the device is known (the strategy's ``setup_environment``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any, Optional

#: The torchao recipes ``float8`` takes (``Float8LinearConfig.from_recipe_name``): one scale per tensor, or per row.
RECIPES = ("tensorwise", "rowwise")
#: The torchao release the suite was checked with (``pip install 'lightning-parallel[float8]'`` installs it).
TORCHAO_RANGE = ">=0.18,<0.19"
INSTALL = f"pip install 'lightning-parallel[float8]' (or pip install 'torchao{TORCHAO_RANGE}')"
#: FP8 tensor cores: compute capability 8.9 (Ada: L4, L40S) and 9.0+ (Hopper H100/H200, Blackwell B200).
MIN_CAPABILITY = (8, 9)


def check_float8_options(float8: Optional[str], all_gather: Optional[bool], zero_stage: int) -> None:
    """Refuse an unknown recipe, FP8 without torchao, or an FP8 all-gather that cannot happen.

    Args:
        float8: ``None`` (off), ``"tensorwise"`` or ``"rowwise"``.
        all_gather: ``float8_all_gather``: None (on where it applies), True (required) or False (off).
        zero_stage: the run's ZeRO stage (only 2/3 all-gather parameters).

    Raises:
        ValueError: each naming the fix.
    """
    if all_gather is not None and not isinstance(all_gather, bool):
        raise ValueError(f"float8_all_gather={all_gather!r}: use true, false or null (on where it applies).")
    if float8 is None:
        if all_gather is not None:
            raise ValueError(f"float8_all_gather={all_gather!r} says how FSDP2 gathers FP8 weights, but float8 is "
                             "off: set float8='tensorwise', or drop float8_all_gather.")
        return
    if float8 not in RECIPES:
        raise ValueError(f"Unknown float8={float8!r}: use 'tensorwise' (one scale per tensor, the fastest) or "
                         "'rowwise' (one scale per row, more accurate), or null for no FP8.")
    _require_torchao(float8)
    if all_gather and float8 != "tensorwise":
        raise ValueError(f"float8_all_gather=True with float8={float8!r}: torchao all-gathers FP8 weights with one "
                         "scale per tensor only (its Float8LinearConfig refuses enable_fsdp_float8_all_gather for "
                         "rowwise scales). Use float8='tensorwise', or float8_all_gather=null (weights gathered in "
                         "high precision, then cast per row).")
    if all_gather and not zero_stage:
        raise ValueError("float8_all_gather=True gathers FSDP2's sharded weights in FP8, but zero_stage=0 shards "
                         "nothing: set zero_stage=3 (or 2), or drop float8_all_gather.")


def torchao_version() -> Optional[str]:
    """The installed torchao's version, or None when it is not installed."""
    if importlib.util.find_spec("torchao") is None:
        return None
    return importlib.metadata.version("torchao")


def _require_torchao(float8: str) -> None:
    version = torchao_version()
    if version is None:
        raise ValueError(f"float8={float8!r} trains through torchao's Float8Linear, and torchao is not installed: "
                         f"{INSTALL}.")
    major_minor = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    if major_minor < (0, 18):
        raise ValueError(f"float8={float8!r} needs torchao 0.18 or newer (its float8 training API as checked here); "
                         f"{version} is installed: {INSTALL}.")


def check_float8_device(float8: Optional[str], device: Any) -> None:
    """Refuse FP8 on a CUDA device without FP8 tensor cores (torch's scaled matmul fails there mid-step).

    On any other device torchao's emulation runs the same numerics in fp32 (:mod:`.convert`).

    Args:
        float8: the ``float8`` option.
        device: this rank's ``torch.device``.

    Raises:
        ValueError: a CUDA device of compute capability below 8.9, naming the fix.
    """
    if float8 is None or getattr(device, "type", None) != "cuda":
        return
    import torch

    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"float8={float8!r} needs FP8 tensor cores (compute capability 8.9+: L4, L40S, H100, H200, "
                         f"B200); {name} is sm_{capability[0]}{capability[1]}: drop strategy.float8 (bf16-mixed "
                         "trains the same model), or run on such a GPU.")
