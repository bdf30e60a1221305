"""Why a ``save_pretrained`` folder does not fit a model, in one message that names the actual difference.

A folder that does not fit can hold another configuration of the same family (eight experts where the model
has four: the stacked experts have another shape), another architecture (its ``config.json`` names another
``model_type``), or the right weights under other names (a state dict saved from the LightningModule, with its
attribute prefix in front). Each has its own remedy; a prefix is suggested only when a prefix explains the keys.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning_parallel.checkpoints.hf.sources import Source

_LISTED = 5  # names shown per kind


def _names(keys: list[str]) -> str:
    return ", ".join(keys[:_LISTED]) + (", ..." if len(keys) > _LISTED else "")


def _where(source: Source) -> str:
    """The stored keys behind a model tensor: one key, or ``n keys first .. last``."""
    keys = source.keys()
    return keys[0] if len(keys) == 1 else f"{len(keys)} keys {keys[0]} .. {keys[-1]}"


def _name(model: Any) -> str:
    return type(model).__name__.removeprefix("FSDP")  # FSDP2 renames the class of a module it shards


def _folder_config(folder: Path) -> Optional[dict[str, Any]]:
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def config_difference(folder: Path, model: Any) -> list[str]:
    """``["num_local_experts 8 (folder) vs 4 (model)", ...]``: the integer settings in which the folder's
    ``config.json`` and the model's config differ (sizes, counts), ``[]`` when either is unknown."""
    stored, config = _folder_config(folder), getattr(model, "config", None)
    if stored is None or not hasattr(config, "to_dict"):
        return []
    own = config.to_dict()
    return [f"{key} {value} (folder) vs {own[key]} (model)" for key, value in sorted(stored.items())
            if isinstance(value, int) and not isinstance(value, bool) and isinstance(own.get(key), int)
            and not isinstance(own.get(key), bool) and value != own[key] and not key.endswith("token_id")]


def prefix_difference(missing: list[str], unexpected: list[str]) -> Optional[tuple[str, str]]:
    """``("extra" | "lacking", prefix)`` when one leading prefix turns the folder's unexpected keys into the model's
    missing ones (most pairs explained wins); None when no prefix explains any."""
    votes: Counter[tuple[str, str]] = Counter()
    wanted = set(missing)
    for key in unexpected:
        parts = key.split(".")
        for cut in range(1, len(parts)):
            if ".".join(parts[cut:]) in wanted:
                votes["extra", ".".join(parts[:cut]) + "."] += 1
    for key in missing:
        parts = key.split(".")
        for cut in range(1, len(parts)):
            if ".".join(parts[cut:]) in set(unexpected):
                votes["lacking", ".".join(parts[:cut]) + "."] += 1
    return votes.most_common(1)[0][0] if votes else None


@dataclass
class Mismatch:
    """What does not fit, as :func:`~lightning_parallel.checkpoints.hf.load.match_folder` found it.

    Attributes:
        missing: model keys the folder does not fill.
        unexpected: folder keys that fill no tensor of the model on any stage.
        shapes: ``{model key: (its source in the folder, the model's shape)}`` where the shapes differ.
    """

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shapes: dict[str, tuple[Source, tuple[int, ...]]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.shapes)

    def cause(self, folder: Path, prefix: str, model: Any) -> str:
        """The remedy: another architecture, another configuration, a prefix, or keys that fit no rule."""
        stored_type = (_folder_config(folder) or {}).get("model_type")
        own_type = getattr(getattr(model, "config", None), "model_type", None)
        if stored_type and own_type and stored_type != own_type:
            return (f"the folder holds a {stored_type!r} model and the module a {own_type!r} one: load a folder of "
                    "the same architecture.")
        differences = config_difference(folder, model)
        if self.shapes and not differences and _folder_config(folder) is not None:
            return ("the folder's config.json matches the model's but its tensors do not: the files were not written "
                    "with this config.json (a partial copy, or an edited config); write the folder again.")
        if self.shapes or differences:
            listed = f" (config.json: {'; '.join(differences[:4])})" if differences else ""
            return (f"the folder holds another configuration of {own_type or _name(model)}{listed}: build "
                    "the model from the folder's config.json (AutoConfig.from_pretrained(DIR); the recipe's "
                    "model.pretrained=DIR does).")
        shifted = prefix_difference(self.missing, self.unexpected)
        if shifted and shifted[0] == "extra":
            return (f"the folder's keys carry an extra leading {shifted[1]!r} (a state dict saved from the module "
                    "holding the model, not save_pretrained of the model): write it with model.save_pretrained(DIR).")
        if shifted:
            return (f"the folder's keys lack the model's leading {shifted[1]!r}: check the prefix (the attribute "
                    f"holding the Hugging Face model, {prefix!r} here).")
        return (f"the keys follow neither {_name(model)}'s names nor transformers' conversion mapping for "
                f"{own_type!r} (what from_pretrained reads): the folder holds another model.")

    def message(self, folder: Path, prefix: str, model: Any) -> str:
        """The whole error: what differs, named, then :meth:`cause`."""
        shapes = [f"{key} is {tuple(source.shape)} from {_where(source)}, {want} in the model"
                  for key, (source, want) in list(self.shapes.items())[:3]]
        return (f"The folder {str(folder)!r} does not fit {_name(model)} under prefix {prefix!r}: missing "
                f"{len(self.missing)} ({_names(self.missing)}), unexpected {len(self.unexpected)} "
                f"({_names(self.unexpected)})" + (f", shapes differ: {'; '.join(shapes)}" if shapes else "")
                + f". Cause: {self.cause(folder, prefix, model)}")
