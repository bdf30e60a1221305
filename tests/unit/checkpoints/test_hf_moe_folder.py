"""Mixture-of-experts ``save_pretrained`` folders on one process (issue 39): per-expert keys in, slices read.

transformers 5.25 writes one key per expert (``mlp.experts.0.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.0.w1.weight``, Granite-MoE's fused ``input_linear``) while the modules hold
``experts.gate_up_proj [E, 2I, H]``. For every family whose experts the suite shards (``EXPERT_FAMILIES``), at the
coverage matrix's tiny size: :func:`load_hf_weights` fills a differently seeded model with exactly what
``from_pretrained`` gives, and ``lp-convert --to hf``'s export writes the keys ``save_pretrained`` writes, which
``from_pretrained`` reads back exactly. A rank's region reads only the experts and rows it covers. A folder that does
not fit is named with its actual difference (configuration, architecture, prefix, stray key), also by ``lp-train``'s
preflight before any process starts. Negative control: a folder with two experts swapped gives other logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="pip install -e '.[hf]'")

from benchmarks.hf_coverage.tiny import tiny_config  # noqa: E402
from lightning_parallel.adapters import adapt  # noqa: E402
from lightning_parallel.adapters.hf.experts import EXPERT_FAMILIES  # noqa: E402
from lightning_parallel.checkpoints.hf.export import export_hf_folder  # noqa: E402
from lightning_parallel.checkpoints.hf.load import load_hf_weights, match_folder  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
PROBE = torch.arange(24).reshape(2, 12) % 60 + 3
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"  # Mixtral at the tiny size: 4 experts, I = 64, H = 32


class Holder(nn.Module):
    """A LightningModule's view of a Hugging Face model: under ``model.``."""

    def __init__(self, config, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = transformers.AutoModelForCausalLM.from_config(config)


def _saved(root: Path, family: str, name: str = "hf", **overrides) -> tuple[Path, Holder]:
    config = tiny_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    holder = Holder(config, seed=0)
    holder.model.save_pretrained(root / name)
    return root / name, holder


def _keys(folder: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return set(handle.keys())


def _worst(state: dict, reference: dict) -> float:
    assert state.keys() == reference.keys()
    return max((state[k].float() - v.float()).abs().max().item() for k, v in reference.items() if v.numel())


@pytest.mark.parametrize("family", sorted(EXPERT_FAMILIES))
def test_every_expert_family_loads_and_exports_what_transformers_does(tmp_path, family):
    folder, source = _saved(tmp_path, family)  # per-expert keys (fused for Inkling and Lara-mini), as the family writes
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()
    target = Holder(tiny_config(family), seed=1)
    report = load_hf_weights(target, folder, "model.")
    assert report["tensors"] == len(target.state_dict())
    assert _worst(target.model.state_dict(), reference) == 0.0
    meta = adapt(source).checkpoint_metadata()
    export_hf_folder(dict(source.state_dict()), tmp_path / "exported", meta)
    assert _keys(tmp_path / "exported") == _keys(folder)  # what save_pretrained writes for the family
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").state_dict()
    assert _worst(exported, reference) == 0.0


class _Recording:
    """A reader that serves stored regions from the folder and records what it read."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.handle = safe_open(str(folder / "model.safetensors"), framework="pt")
        self.read: list[str] = []

    def __call__(self, key, region):
        self.read.append(key)
        return self.handle.get_slice(key)[tuple(slice(a, b) for a, b in region)]


@pytest.mark.parametrize(
    ("region", "experts"),
    [(((2, 4), (0, 128), (0, 32)), {2, 3}),  # expert rank 1 of 2
     (((0, 4), (32, 96), (0, 32)), {0, 1, 2, 3}),  # rows across the gate/up boundary (I = 64)
     (((1, 2), (0, 128), (8, 24)), {1})],  # one expert, a column range
    ids=["experts-2-3", "gate-up-rows", "one-expert-columns"],
)
def test_a_region_reads_only_the_experts_and_rows_it_covers(tmp_path, region, experts):
    folder, source = _saved(tmp_path, "mixtral")
    match = match_folder(Holder(tiny_config("mixtral"), seed=1), folder, "model.")
    reader = _Recording(folder)
    part = match.sources[GATE_UP].read(region, reader)
    full = source.model.state_dict()[GATE_UP]
    assert torch.equal(part, full[tuple(slice(a, b) for a, b in region)])
    assert {int(key.split(".experts.")[1].split(".")[0]) for key in reader.read} == experts


def test_a_folder_with_the_modules_own_fused_keys_loads_as_well(tmp_path):
    from safetensors.torch import save_file

    folder, source = _saved(tmp_path, "qwen3_moe")
    state = {k: v.contiguous() for k, v in source.model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert GATE_UP.replace("1", "0") in _keys(folder)
    target = Holder(tiny_config("qwen3_moe"), seed=1)
    load_hf_weights(target, folder, "model.")
    assert _worst(target.model.state_dict(), source.model.state_dict()) == 0.0


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def test_control_two_experts_swapped_in_the_folder_give_other_logits(tmp_path):
    from safetensors.torch import load_file, save_file

    folder, source = _saved(tmp_path, "mixtral")
    stored = load_file(str(folder / "model.safetensors"))
    swap = {".experts.0.": ".experts.1.", ".experts.1.": ".experts.0."}
    stored = {next((k.replace(a, b) for a, b in swap.items() if a in k), k): v for k, v in stored.items()}
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    target = Holder(tiny_config("mixtral"), seed=1)
    load_hf_weights(target, folder, "model.")
    assert (_logits(target.model) - _logits(source.model)).abs().max() > 1e-3  # the comparison can fail
    swapped = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert torch.equal(_logits(target.model), _logits(swapped))  # the loader follows the file, as transformers


def test_a_folder_with_more_experts_is_named_as_another_configuration_not_a_prefix(tmp_path):
    folder, _ = _saved(tmp_path, "mixtral", num_local_experts=8)
    with pytest.raises(ValueError) as raised:
        load_hf_weights(Holder(tiny_config("mixtral"), seed=1), folder, "model.")
    message = str(raised.value)
    print(message)
    assert "model.layers.0.mlp.experts.gate_up_proj is (8, 128, 32) from 16 keys" in message
    assert "(4, 128, 32) in the model" in message
    assert "num_local_experts 8 (folder) vs 4 (model)" in message and "prefix" not in message.split("Cause:")[1]


def test_a_partial_folder_another_architecture_and_a_prefix_are_each_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder, source = _saved(tmp_path, "mixtral")
    model = Holder(tiny_config("mixtral"), seed=1)
    stored = load_file(str(folder / "model.safetensors"))
    partial = {k: v for k, v in stored.items() if ".experts.3." not in k}
    save_file(partial, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"is \(3, 128, 32\) from 6 keys .*config.json matches the model's"):
        match_folder(model, folder, "model.")
    other, _ = _saved(tmp_path, "qwen3_moe", name="qwen")
    with pytest.raises(ValueError, match="the folder holds a 'qwen3_moe' model and the module a 'mixtral' one"):
        match_folder(model, other, "model.")
    # A LightningModule's state dict with the model at ``net.`` (``model.`` alone is the base model's prefix, which
    # from_pretrained and the loader both take off).
    save_file({f"net.{k}": v.contiguous() for k, v in source.model.state_dict().items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="carry an extra leading 'net.'"):
        match_folder(model, folder, "model.")
    save_file({**stored, "stray.weight": torch.zeros(2)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 0 \(\), unexpected 1 \(stray.weight\)"):
        match_folder(model, folder, "model.")


def _compose(*overrides):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lightning_parallel.cli.train import CONFIG_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("config", overrides=[*overrides, "strategy=ddp", "trainer.devices=2", "callbacks=none",
                                            "paths.output_dir=/tmp/lp-moe-folder-test"])


def test_lp_train_preflight_names_a_folder_that_does_not_fit_before_any_process(tmp_path):
    from lightning_parallel.cli.preflight import ConfigError, preflight

    folder, _ = _saved(tmp_path, "mixtral")
    preflight(_compose("model=hf_causal_lm", f"model.pretrained={folder}"))  # fits: no error
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_local_experts": 8}))
    with pytest.raises(ConfigError, match=f"model.pretrained={folder}: .* is \\(4, 128, 32\\) from 8 keys"):
        preflight(_compose("model=hf_causal_lm", f"model.pretrained={folder}"))
    other, _ = _saved(tmp_path, "qwen3_moe", name="qwen")
    weights = ["+callbacks.hf_weights._target_=lightning_parallel.callbacks.HuggingFaceWeights",
               f"+callbacks.hf_weights.folder={other}"]
    with pytest.raises(ConfigError, match=f"callbacks.hf_weights.folder={other}: .* a 'qwen3_moe' model"):
        preflight(_compose("model=hf_causal_lm", f"model.config={tmp_path / 'hf'}", *weights))
