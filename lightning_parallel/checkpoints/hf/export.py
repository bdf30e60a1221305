"""Checkpoint weights as a Hugging Face folder: ``lp-convert CKPT OUT --to hf``, then ``from_pretrained(OUT)``.

The folder is what ``save_pretrained`` writes (``config.json``, ``model.safetensors`` --
sharded with an index file when large -- and ``generation_config.json``), because it *is*
written by ``save_pretrained``: the weights, with the LightningModule's attribute prefix
(``model.``) taken off, are assigned into the Hugging Face class built on the meta device
(no second copy in memory), its tied weights are tied again, and transformers stores them
as it expects (a tied LM head once, under the embedding's name).

What to build comes from the checkpoint's ``hugging_face`` entry (``{"prefix", "class",
"config"}``, written by the suite's strategies for a module holding a ``PreTrainedModel``)
or, for a checkpoint without it, from ``--hf-config`` (a ``config.json`` or a folder holding
one); the prefix is then found as the one under which the weights match the model's keys.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_parallel.adapters.hf.adapter import HF_KEY


def _config_from(entry_config: Any) -> Any:
    """A transformers config from a ``to_dict()`` dict, its JSON text, or a path to ``config.json``/its folder."""
    from transformers import AutoConfig

    if isinstance(entry_config, (str, Path)) and Path(entry_config).exists():
        path = Path(entry_config)
        entry_config = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    elif isinstance(entry_config, str):
        entry_config = json.loads(entry_config)
    if not isinstance(entry_config, dict) or "model_type" not in entry_config:
        raise ValueError("The Hugging Face config must be a config.json (or its dict) with a 'model_type'.")
    settings = dict(entry_config)
    return AutoConfig.for_model(settings.pop("model_type"), **settings)


def _model_class(config: Any, class_name: Optional[str]) -> Any:
    """The transformers class to build: the recorded one, else the config's ``architectures[0]``, else a causal LM."""
    import transformers

    name = (class_name or "").rsplit(".", 1)[-1] or next(iter(getattr(config, "architectures", None) or []), "")
    if not name:
        return transformers.AutoModelForCausalLM
    found = getattr(transformers, name, None)
    if found is None:
        raise ValueError(f"transformers {transformers.__version__} has no class {name!r} (recorded in the checkpoint).")
    return found


def hf_target(meta: dict[str, Any], hf_config: Optional[Path] = None) -> tuple[Any, Any, Optional[str]]:
    """``(config, model class, prefix or None)`` for a checkpoint's Lightning entries.

    Args:
        meta: Lightning's checkpoint entries (``meta.pt`` of a suite folder, or a ``.ckpt`` file's dict).
        hf_config: ``--hf-config``: a ``config.json`` or its folder; wins over the recorded config.

    Raises:
        ValueError: neither a ``hugging_face`` entry nor ``hf_config``.
    """
    entry = meta.get(HF_KEY) or {}
    if hf_config is None and not entry.get("config"):
        raise ValueError(
            "The checkpoint does not say which Hugging Face model it holds (no 'hugging_face' entry: it was not "
            "written by a lightning_parallel strategy around a PreTrainedModel): pass --hf-config CONFIG_JSON_OR_DIR."
        )
    config = _config_from(hf_config if hf_config is not None else entry["config"])
    prefix = entry.get("prefix")
    if prefix and not prefix.endswith("."):  # recorded as an attribute path ("model"), matched with its dot
        prefix += "."
    return config, _model_class(config, entry.get("class")), prefix


def _stripped(weights: dict[str, torch.Tensor], prefix: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    kept = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    return kept, sorted(k for k in weights if not k.startswith(prefix))


def find_prefix(weights: dict[str, torch.Tensor], expected: set[str]) -> str:
    """The attribute prefix under which ``weights`` hold the keys ``expected`` (``""`` or ``"model."``, ...).

    Raises:
        ValueError: no prefix makes every expected key present.
    """
    candidates = {""} | {
        key[: len(key) - len(name)] for key in weights for name in expected if key.endswith("." + name)
    }
    best = max(sorted(candidates), key=lambda p: len(expected & _stripped(weights, p)[0].keys()))
    missing = sorted(expected - _stripped(weights, best)[0].keys())
    if missing:
        raise ValueError(f"No attribute prefix makes the checkpoint's weights match the Hugging Face model: "
                         f"under {best!r}, {len(missing)} keys are missing ({missing[:3]}). "
                         "Is --hf-config the right model?")
    return best


def _build(
    weights: dict[str, torch.Tensor], config: Any, model_class: Any, prefix: Optional[str]
) -> tuple[Any, list[str]]:
    """The Hugging Face model holding ``weights`` (assigned, not copied), tied weights tied; and the keys left out."""
    with torch.device("meta"):
        model = model_class.from_config(config) if hasattr(model_class, "from_config") else model_class(config)
    expected = set(model.state_dict())
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})  # empty unless the config ties them
    prefix = find_prefix(weights, expected - tied.keys()) if prefix is None else prefix
    state, outside = _stripped(weights, prefix)
    for copy, source in tied.items():
        if copy in state and not torch.equal(state[copy], state[source]):
            raise ValueError(f"{copy!r} should be tied to {source!r} (config.tie_word_embeddings) but holds other "
                             "values: the run untied them. Export with a config that has tie_word_embeddings=False.")
        state[copy] = state[source]
    unexpected = sorted(state.keys() - expected)
    missing = sorted(expected - state.keys())
    if unexpected or missing:
        raise ValueError(f"The weights under prefix {prefix!r} do not fit {type(model).__name__}: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}.")
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    return model, outside


def export_hf_folder(
    weights: dict[str, torch.Tensor], out: Path, meta: dict[str, Any], hf_config: Optional[Path] = None
) -> tuple[Path, list[str]]:
    """Write ``weights`` as a ``save_pretrained`` folder (a hidden partial folder, then a rename).

    Args:
        weights: full tensors under the LightningModule's names.
        out: the folder to write; an existing one is replaced.
        meta: the checkpoint's Lightning entries (for the ``hugging_face`` entry).
        hf_config: see :func:`hf_target`.

    Returns:
        The folder, and the names of weights outside the Hugging Face model (not exported).
    """
    config, model_class, prefix = hf_target(meta, hf_config)
    model, outside = _build(weights, config, model_class, prefix)
    out = Path(out)
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    partial.rename(out)
    return out, outside
