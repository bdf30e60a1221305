"""Did-you-mean for the command line's overrides, from Hydra's own config repository, before Hydra composes.

Hydra answers ``strategy=hybird`` with 7-22 lines (every option, its search path) and
``strategy.tensor_paralel_size=2`` with advice to append ``+strategy.tensor_paralel_size=2``, which leads into a
second error (the strategy takes no such argument). Here each is one line: the closest group option, experiment or
key, or -- for a key that exists under another option of its group (``strategy.microbatches`` under ``ddp``) --
the options that have it. Valid command lines pass unchanged (one extra compose, about 0.1 s).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from lightning_parallel.cli.suggest import closest


@contextmanager
def config_repository(config_dir: str) -> Iterator[Any]:
    """Hydra's config loader over ``config_dir`` (its ``get_group_options``, ``list_groups``), for the ``with``
    block; Hydra's global state is cleared after it, so the app that follows starts as it would have."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lightning_parallel.cli.run_folder import register_resolver

    register_resolver()
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        yield GlobalHydra.instance().config_loader()


def _parsed(overrides: list[str]) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 - a syntax error: Hydra's own message names the position
        return []


def _values(override: Any) -> list[str]:
    """The values of a choice (each of a sweep's ``a,b``); empty for what is not a plain choice."""
    if override.is_sweep_override():
        try:
            return list(override.sweep_string_iterator())
        except Exception:  # noqa: BLE001 - ranges and intervals are no group options
            return []
    value = override.value()
    return [value] if isinstance(value, str) else []


def check_group_choices(parsed: list[Any], loader: Any) -> None:
    """``strategy=hybird``, ``experiment=nlp_gtp``: an option the group does not have, with the closest.

    Args:
        parsed: Hydra's parsed overrides.
        loader: Hydra's config loader (:func:`config_repository`).

    Raises:
        ValueError: the first unknown option.
    """
    groups = set(loader.list_groups("")) - {"hydra"}
    for override in parsed:
        key = override.key_or_group
        if key not in groups or override.is_delete():
            continue
        options = loader.get_group_options(key)
        for value in _values(override):
            if value in options or value in ("null", "None"):
                continue
            near = closest(value, options)
            hint = f"did you mean {key}={near}? " if near else ""
            raise ValueError(f"{key}={value} is not in conf/{key}/: {hint}Choose one of {', '.join(options)}.")


def _choices(parsed: list[Any], groups: set[str]) -> Optional[list[str]]:
    """What to compose with before the keys are looked up: the group choices and the overrides that add or delete
    keys (``+model.moe={...}`` makes ``model.moe.num_experts`` a key); None when one is a sweep (each job composes
    its own)."""
    from hydra.core.override_parser.types import OverrideType

    chosen = []
    for override in parsed:
        if override.key_or_group in groups or override.type != OverrideType.CHANGE:
            if override.is_sweep_override():
                return None
            chosen.append(override.input_line)
    return chosen


def _missing_key(cfg: DictConfig, key: str) -> Optional[tuple[list[str], int, list[str]]]:
    """``(the key's parts, the index of the first missing one, the keys beside it)`` when ``key`` is not in ``cfg``
    (None when it is). Under a plain value (``strategy: auto`` of ``strategy=single``) nothing is beside it."""
    parts = key.split(".")
    node: Any = cfg
    for depth, part in enumerate(parts):
        if OmegaConf.is_list(node):
            return None  # an index into a list: Hydra's own message is precise
        if not OmegaConf.is_dict(node):
            return parts, depth, []
        names = [str(k) for k in node.keys()]
        if part not in names:  # not `part in node`: a DictConfig answers False for a key whose value is null
            return parts, depth, names
        node = node[part]
    return None


def _options_having(loader: Any, compose: Any, group: str, rest: str, base: list[str]) -> list[str]:
    """The options of ``group`` whose config has ``group.rest`` (``strategy.microbatches``: pipeline, hybrid)."""
    found = []
    for option in loader.get_group_options(group):
        try:
            cfg = compose("config", overrides=[*base, f"{group}={option}"])
        except Exception:  # noqa: BLE001 - an option that does not compose alone says nothing here
            continue
        if _missing_key(cfg, f"{group}.{rest}") is None:
            found.append(option)
    return found


def _key_error(key: str, value: str, missing: tuple[list[str], int, list[str]], cfg: DictConfig,
               having: list[str]) -> str:
    """The one line for a key the config lacks: the closest key, the options of its group that have it, or what
    is there."""
    parts, depth, siblings = missing
    group = parts[0]
    chosen = OmegaConf.select(cfg, f"hydra.runtime.choices.{group}", default=None)
    of = f" of {group}={chosen}" if chosen else ""
    near = closest(parts[depth], siblings)
    if near:
        meant = ".".join([*parts[:depth], near, *parts[depth + 1:]])
        return f"{key} is not a setting{of}: did you mean {meant}={value}?"
    if having:
        # The option named in the key (tensor for tensor_parallel_size), else hybrid (the general case), else the first.
        best = next((o for o in having if o in parts[-1]), "hybrid" if "hybrid" in having else having[0])
        return (f"{key} is not a setting{of}; {group}={', '.join(having)} {'has' if len(having) == 1 else 'have'} "
                f"it: add {group}={best} (a '+' would pass it to {chosen or 'the current choice'}, which does "
                "not take it).")
    parent = ".".join(parts[:depth]) or "the config"
    if not siblings and depth and OmegaConf.select(cfg, parent) is None:  # a null node: set it whole
        rest = ".".join(parts[depth:])
        return f"{key} is not a setting{of}: {parent} is null; give it whole, e.g. {parent}={{{rest}:{value}}}."
    if not siblings:
        return f"{key} is not a setting{of}: {parent} takes no settings there."
    listed = ", ".join(siblings[:12]) + (", ..." if len(siblings) > 12 else "")
    return f"{key} is not a setting{of}: {parent} has {listed}. Add '+' only for a new key on purpose."


def check_keys(parsed: list[Any], loader: Any) -> None:
    """``strategy.tensor_paralel_size=2``: a key the composed config lacks, with the closest key, or the options of
    its group that have it. ``+key`` and ``++key`` (a new key on purpose) and ``hydra.*`` are left to Hydra.

    Args:
        parsed: Hydra's parsed overrides.
        loader: Hydra's config loader (:func:`config_repository`).

    Raises:
        ValueError: the first key that is not in the config.
    """
    from hydra import compose
    from hydra.core.override_parser.types import OverrideType

    groups = set(loader.list_groups("")) - {"hydra"}
    base = _choices(parsed, groups)
    keys = [o for o in parsed
            if o.type == OverrideType.CHANGE and "." in o.key_or_group and not o.key_or_group.startswith("hydra.")]
    if base is None or not keys:
        return
    try:
        cfg = compose("config", overrides=base, return_hydra_config=True)
    except Exception:  # noqa: BLE001 - Hydra reports what does not compose, in its own words
        return
    for override in keys:
        missing = _missing_key(cfg, override.key_or_group)
        if missing is None:
            continue
        group, _, rest = override.key_or_group.partition(".")
        having = []
        if group in groups and not closest(missing[0][missing[1]], missing[2]):
            others = [c for c in base if not c.lstrip("+~").startswith((f"{group}=", f"{group}."))]
            having = _options_having(loader, compose, group, rest, others)
        value = (override.input_line or "=...").split("=", 1)[1]  # as typed (Hydra's own form escapes ':')
        raise ValueError(_key_error(override.key_or_group, value, missing, cfg, having))


def check_overrides(overrides: list[str], config_dir: str) -> None:
    """Check the command line's group options and keys against the config repository, before Hydra composes.

    Args:
        overrides: the command line's ``key=value`` arguments.
        config_dir: the primary config folder (``conf/``).

    Raises:
        ValueError: one line with did-you-mean (the caller prints it, exit code 2).
    """
    parsed = _parsed([o for o in overrides if not o.startswith("hydra.")])
    if not parsed:
        return
    with config_repository(config_dir) as loader:
        check_group_choices(parsed, loader)
        check_keys(parsed, loader)
