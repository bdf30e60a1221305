"""Every ``_target_`` of the config against the signature it will be called with, before any process starts.

``+model.dropuot=0.1`` or ``+data.bach_size=8`` composed without complaint and failed in every rank as Hydra's
"Error in call to target '...GPT':" (the ``TypeError`` behind it in the log only); a ``_target_`` with a typo failed
the same way. Here the class or function is imported (never called) and each key of its node checked against its
parameters, with the closest one; a target that takes ``**kwargs`` accepts any key.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_parallel.cli.suggest import closest

# Hydra's own keys of an instantiated node (hydra.utils.instantiate reads them, the target never sees them).
_HYDRA_KEYS = {"_target_", "_partial_", "_args_", "_recursive_", "_convert_"}
# Checked elsewhere: the trainer (with Lightning's arguments, cli/preflight.py), Hydra's own config.
_SKIPPED = ("trainer", "hydra")


def _targets(node: Any, path: str) -> Iterator[tuple[str, dict]]:
    """``(path, node)`` of every dict with a ``_target_`` under ``node`` (plain containers; nested ones included)."""
    if isinstance(node, dict):
        if "_target_" in node:
            yield path, node
        for key, value in node.items():
            if not path and str(key) in _SKIPPED:
                continue
            yield from _targets(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _targets(value, f"{path}[{index}]")


def _parameters(target: Any) -> tuple[list[str], bool]:
    """The keyword names ``target`` takes, and whether it takes any (``**kwargs``)."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return [], True  # a builtin without a signature: nothing to check against
    names = [p.name for p in signature.parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return names, any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())


def _locate(path: str, target_name: str) -> Any:
    """The object ``target_name`` names (the longest importable module, then attributes), as Hydra finds it."""
    import importlib

    parts = target_name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                found = getattr(found, attribute)
            return found
        except AttributeError:
            break
    module = target_name.rpartition(".")[0]
    raise ValueError(f"{path}._target_={target_name} cannot be imported: check the name (module {module or '?'}) "
                     "and that its package is installed.")


def check_built_nodes(cfg: DictConfig) -> None:
    """``model``, ``data`` and a ``strategy`` given as settings must name what builds them (``_target_``).

    ``strategy=single +strategy.microbatches=2`` turned Lightning's ``auto`` into ``{microbatches: 2}``, which reached
    the Trainer as a strategy.

    Raises:
        ValueError: the node, its keys and the fix.
    """
    for name in ("model", "data", "strategy"):
        node = cfg.get(name)
        if name == "strategy" and OmegaConf.is_dict(node) and node.get("planned"):
            continue  # strategy=planned: the planner puts the built strategy in its place (cli/planned.py)
        if OmegaConf.is_dict(node) and "_target_" not in node:
            keys = ", ".join(str(k) for k in node.keys())
            raise ValueError(f"{name} has settings ({keys}) but no _target_ to build it with: the {name} chosen "
                             f"takes no settings (strategy=single is Lightning's own 'auto'); drop them, or choose "
                             f"a {name} that has them.")


def check_targets(cfg: DictConfig) -> None:
    """Refuse a key the target of its node does not take, or a ``_target_`` that cannot be imported.

    Args:
        cfg: the composed config (nothing is instantiated; interpolations are not resolved).

    Raises:
        ValueError: ``model.dropuot is not an argument of ...GPT: did you mean model.dropout?``
    """
    check_built_nodes(cfg)
    for path, node in _targets(OmegaConf.to_container(cfg, resolve=False), ""):
        target_name = node.get("_target_")
        if not isinstance(target_name, str) or "${" in target_name:
            continue  # an interpolation: resolved only when the run builds it
        names, any_key = _parameters(_locate(path, target_name))
        if any_key:
            continue
        for key in node.keys():
            key = str(key)
            if key in _HYDRA_KEYS or key in names:
                continue
            near = closest(key, names)
            hint = f"did you mean {path}.{near}? " if near else ""
            raise ValueError(f"{path}.{key} is not an argument of {target_name}: {hint}It takes "
                             f"{', '.join(names)}.")
