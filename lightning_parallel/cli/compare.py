"""``lp-compare``: the same experiment under several layouts, compared step by step with the first.

``lp-compare experiment=nlp_gpt compare.layouts='[single:1,pipeline:2,tensor:2,hybrid:4]' compare.steps=10``
composes ``lp-train``'s config (``conf/``, the same overrides) once per layout -- each entry a
``conf/strategy/`` name and a device count (``NAME:DEVICES``), or the sizes of a hybrid layout as
:meth:`~lightning_parallel.layout.ParallelLayout.describe` spells them, without spaces
(``dp2xcp2xpp1xtp1``, axes left out are 1: ``cp4``, ``dp2xcp2``; ``ep2`` spreads each MoE layer's experts over 2
of the data x context ranks, as ``strategy.expert_parallel_size``, and adds no devices: ``dp2xep2``), optionally with
the context method (``cp4:ulysses``; ring by default) and run on the product of dp, cp, pp and tp -- checks it with
:func:`~lightning_parallel.cli.preflight.preflight`,
and runs :func:`~lightning_parallel.testing.compare.compare_layouts` on it. Every layout trains on
the same global batch (``compare.global_batch_size``; the per-rank ``data.batch_size`` is derived
from each layout's data-parallel size) in the same order, with the configured lr and schedule as
they are (no rescaling: ``scaling`` is ignored), and nothing is written (no logger, no checkpoints,
no validation). It prints the per-step table and exits 1 when a layout is beyond ``compare.tolerance``
(2 for a configuration error).
"""

from __future__ import annotations

import re
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_parallel.cli.preflight import ConfigError, preflight
from lightning_parallel.cli.train import CONFIG_DIR

# Trainer settings of the composed config that change the optimisation, passed to every layout.
TRAINER_KEYS = ("precision", "gradient_clip_val", "gradient_clip_algorithm", "accumulate_grad_batches")
# The command line's strategy.* overrides, applied per layout (see main()).
_STRATEGY_OVERRIDES: list[str] = []


def parse_layout(entry: str) -> tuple[str, int]:
    """``"pipeline:2"`` -> ``("pipeline", 2)``: a ``conf/strategy/`` name and a device count."""
    name, sep, devices = str(entry).rpartition(":")
    if not sep or not name or not devices.strip().isdigit() or int(devices) < 1:
        raise ConfigError(
            f"compare.layouts entry {entry!r} is not NAME:DEVICES (e.g. pipeline:2, a conf/strategy/ name) nor "
            "sizes (e.g. dp2xcp2, cp4:ulysses: the hybrid strategy on their product of devices)."
        )
    return name.strip(), int(devices)


_AXES = {"dp": "data_parallel_size", "cp": "context_parallel_size", "pp": "pipeline_parallel_size",
         "tp": "tensor_parallel_size", "ep": "expert_parallel_size"}
_SIZE = re.compile(r"(dp|cp|pp|tp|ep)(\d+)")
_METHODS = ("ring", "ulysses")


@dataclass(frozen=True)
class SizesEntry:
    """A ``compare.layouts`` entry spelled by its sizes: the hybrid strategy (``conf/strategy/hybrid.yaml``) with them.

    Args:
        sizes: ``{"dp": 2, "cp": 2, "pp": 1, "tp": 1, "ep": 1}`` (every axis; ``ep`` borrows dp x cp ranks).
        method: the context-parallel method (None: the strategy file's, ring).
    """

    sizes: dict
    method: Optional[str] = None

    @property
    def devices(self) -> int:
        """Processes the layout runs on: the product of dp, cp, pp and tp (ep borrows from dp x cp)."""
        return self.sizes["dp"] * self.sizes["cp"] * self.sizes["pp"] * self.sizes["tp"]

    @property
    def label(self) -> str:
        """``dp1xcp2xpp1xtp1:ring`` (the method shown under context parallelism; ``xep2`` under expert parallelism)."""
        spelled = "x".join(f"{axis}{self.sizes[axis]}" for axis in _AXES if axis != "ep" or self.sizes["ep"] > 1)
        return spelled + (f":{self.method or 'ring'}" if self.sizes["cp"] > 1 else "")

    def overrides(self) -> list[str]:
        """The ``strategy.*`` overrides of ``strategy=hybrid`` that run these sizes (ZeRO and the rest from the file
        and the command line's ``strategy.*``)."""
        out = [f"strategy.{_AXES[axis]}={size}" for axis, size in self.sizes.items()]
        return out + ([f"strategy.context_parallel_method={self.method}"] if self.method else [])


def parse_sizes(entry: str) -> Optional[SizesEntry]:
    """``"dp2xcp2"`` / ``"cp4:ulysses"`` -> a :class:`SizesEntry`; None when ``entry`` is not spelled by sizes.

    Raises:
        ConfigError: sizes spelled wrongly (an axis twice, a size below 1, an unknown method).
    """
    spelled, sep, method = str(entry).strip().partition(":")
    parts = spelled.split("x")
    if not all(_SIZE.fullmatch(part) for part in parts):
        return None
    axes = [_SIZE.fullmatch(part).groups() for part in parts]
    names = [axis for axis, _ in axes]
    if len(set(names)) < len(names) or any(int(size) < 1 for _, size in axes):
        raise ConfigError(f"compare.layouts entry {entry!r}: give each of dp, cp, pp, tp, ep at most once, each >= 1 "
                          "(e.g. dp2xcp2xpp1xtp1, cp4, or dp2xep2).")
    if sep and method.strip() not in _METHODS:
        raise ConfigError(f"compare.layouts entry {entry!r}: the context method after ':' is one of {_METHODS} "
                          "(e.g. cp2:ulysses).")
    sizes = {axis: 1 for axis in _AXES} | {axis: int(size) for axis, size in axes}
    if (sizes["dp"] * sizes["cp"]) % sizes["ep"]:
        raise ConfigError(f"compare.layouts entry {entry!r}: ep{sizes['ep']} borrows ranks from dp x cp = "
                          f"{sizes['dp'] * sizes['cp']}, which it must divide (e.g. dp{sizes['ep']}xep{sizes['ep']}).")
    return SizesEntry(sizes, method.strip() if sep else None)


@dataclass(frozen=True)
class ConfigData:
    """Builds the config's data module with the per-rank batch of a layout (picklable, for the ranks).

    Args:
        data: the resolved ``data`` config (``_target_`` and arguments).
        global_batch_size: samples per optimizer step across the data-parallel ranks.
    """

    data: dict
    global_batch_size: int

    def __call__(self, layout: Any) -> Any:
        from hydra.utils import instantiate

        return instantiate({**self.data, "batch_size": self.global_batch_size // layout.data_parallel})


def _instantiate(config: Any) -> Any:
    from hydra.utils import instantiate

    return instantiate(config)


def _user_overrides() -> list[str]:
    """The command line's overrides, without the strategy and device choices each layout makes."""
    from hydra.core.hydra_config import HydraConfig

    skip = ("strategy=", "trainer.devices=", "compare=", "compare.")
    return [o for o in HydraConfig.get().overrides.task if not o.lstrip("+~").startswith(skip)] + _STRATEGY_OVERRIDES


def compose_layout(name: str, devices: int, overrides: list[str], output_dir: str,
                   layout_overrides: Sequence[str] = ()) -> DictConfig:
    """The config ``lp-train`` would run for ``strategy=name trainer.devices=devices`` plus the user's overrides.

    ``strategy.*`` overrides apply only where the strategy is an object (not ``single``'s ``auto``);
    ``layout_overrides`` (a sizes entry's ``strategy.*``) come last and win.
    """
    from hydra import compose

    base = [o for o in overrides if not o.lstrip("+~").startswith("strategy.")]
    fixed = [f"strategy={name}", f"trainer.devices={devices}", f"paths.output_dir={output_dir}", *layout_overrides]
    try:
        cfg = compose("config", overrides=[*base, *fixed])
        if not isinstance(cfg.strategy, str) and len(base) < len(overrides):
            cfg = compose("config", overrides=[*overrides, *fixed])
    except Exception as exc:  # noqa: BLE001 - Hydra's own errors (unknown group option, bad key) name the fix
        raise ConfigError(f"layout {name}:{devices}: {exc}") from exc
    return cfg


def _accelerator(cfg: DictConfig) -> str:
    import torch

    accelerator = str(cfg.trainer.accelerator)
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if accelerator == "gpu" else accelerator


def build_layouts(cfg: DictConfig, output_dir: str) -> tuple[list[Any], DictConfig]:
    """One :class:`~lightning_parallel.testing.compare.Layout` per ``compare.layouts`` entry (checked
    with ``preflight``), and the reference layout's config."""
    from lightning_parallel.testing.compare import Layout

    overrides, layouts, reference = _user_overrides(), [], None
    for entry in cfg.compare.layouts:
        sizes = parse_sizes(entry)
        if sizes is None:
            name, devices = parse_layout(entry)
            extra, label = [], f"{name}:{devices}"
        else:
            name, devices, extra, label = "hybrid", sizes.devices, sizes.overrides(), sizes.label
        layout_cfg = compose_layout(name, devices, overrides, output_dir, extra)
        strategy, parallel_layout = preflight(layout_cfg)
        if sizes is None and getattr(parallel_layout, "expert_parallel", 1) > 1:  # from strategy.* on the line
            label += f" (ep{parallel_layout.expert_parallel})"
        if reference is None:
            reference = (layout_cfg, parallel_layout)
        config = strategy if isinstance(strategy, str) else OmegaConf.to_container(layout_cfg.strategy, resolve=True)
        factory = config if isinstance(config, str) else partial(_instantiate, config)
        layouts.append(Layout(factory, devices, name=label))
    return layouts, reference


def _global_batch(cfg: DictConfig, reference_dp: int) -> int:
    configured = cfg.compare.get("global_batch_size")
    return int(configured) if configured else int(cfg.data.batch_size) * reference_dp


def _tolerance(cfg: DictConfig) -> Any:
    value = cfg.compare.tolerance
    return "auto" if str(value) == "auto" else float(value)


def run_comparison(cfg: DictConfig) -> Any:
    """Compose every layout, run the comparison, print its tables; returns the :class:`LayoutComparison`."""
    import time

    from lightning_parallel.testing.compare import compare_layouts

    output_dir = tempfile.mkdtemp(prefix="lp-compare-")
    layouts, (ref_cfg, ref_layout) = build_layouts(cfg, output_dir)
    global_batch = _global_batch(cfg, ref_layout.data_parallel)
    data = OmegaConf.to_container(ref_cfg.data, resolve=True)
    trainer_kwargs = {k: ref_cfg.trainer[k] for k in TRAINER_KEYS if ref_cfg.trainer.get(k) is not None}
    module_factory = partial(_instantiate, OmegaConf.to_container(ref_cfg.model, resolve=True))
    started = time.monotonic()
    result = compare_layouts(
        module_factory, ConfigData(data, global_batch), layouts, int(cfg.compare.steps), _tolerance(cfg),
        trainer_kwargs=trainer_kwargs, seed=int(cfg.seed), accelerator=_accelerator(ref_cfg),
        timeout=float(cfg.compare.timeout), trace=bool(cfg.compare.get("trace", False)),
    )
    result.notes.append(f"lp-compare: {len(layouts)} layouts x {cfg.compare.steps} steps, global batch {global_batch}, "
                        f"{time.monotonic() - started:.1f}s")
    result.print()
    return result


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def _main(cfg: DictConfig) -> Optional[bool]:
    with open_dict(cfg):
        cfg.setdefault("compare", OmegaConf.load(f"{CONFIG_DIR}/compare/default.yaml"))
    try:
        result = run_comparison(cfg)
    except ConfigError as error:
        print(f"lp-compare: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    if not result:
        sys.exit(1)
    return True


def main() -> None:
    """Console entry point (``lp-compare``): ``lp-train``'s config plus the ``compare`` group.

    ``strategy.*`` overrides are set aside here and applied per layout (:func:`compose_layout`): the
    config's default strategy (e.g. ``ddp``) may not have the setting every other layout has.
    """
    if any(a in ("--help", "-h") for a in sys.argv[1:]):  # ours, not Hydra's stock page (--hydra-help keeps that)
        from lightning_parallel.cli.help_text import COMPARE, hydra_app_help

        print(hydra_app_help(**COMPARE, config_dir=CONFIG_DIR))
        return
    _STRATEGY_OVERRIDES[:] = [arg for arg in sys.argv[1:] if arg.lstrip("+~").startswith("strategy.")]
    sys.argv[1:] = [arg for arg in sys.argv[1:] if arg not in _STRATEGY_OVERRIDES]
    if not any(arg.lstrip("+").startswith("compare=") for arg in sys.argv[1:]):
        sys.argv.insert(1, "+compare=default")
    _check_overrides(sys.argv[1:])
    _main()


def _check_overrides(args: list[str]) -> None:
    """Group options and keys against ``conf/`` with did-you-mean (as ``lp-train``), before Hydra composes."""
    from lightning_parallel.cli.overrides_check import check_overrides

    if any(a.startswith(("--config", "-c")) or a.lstrip("+").startswith("hydra.searchpath") for a in args):
        return
    try:
        check_overrides([a for a in args if "=" in a and not a.startswith("-")], CONFIG_DIR)
    except ValueError as error:
        print(f"lp-compare: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
