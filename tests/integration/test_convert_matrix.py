"""``lp-convert`` takes every checkpoint the suite writes into every output, and its own outputs on again.

Sources, made for real once per module (``convert_sources.py``): ``lp-train strategy=single`` (a Lightning
file whose hyper-parameters hold an OmegaConf DictConfig), the README's first look under Lightning's DDP
(GPT-MoE, weight-decay groups), ``strategy=hybrid`` (the suite's DCP folder), ``strategy=deepspeed`` at
ZeRO 0 (optimizer state by position) and ZeRO 2, and Lightning's ``ModelParallelStrategy`` (a Lightning
DCP folder). Each goes to dcp, lightning, pt and hf (Hugging Face models only); each dcp and lightning
output goes to all four again. Every output holds exactly the source's weights, and where it carries
optimizer state, exactly the source's, parameter by parameter, with the groups named by the module's own
``configure_optimizers``.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from lightning_parallel.checkpoints.detect import read_lightning_checkpoint
from lightning_parallel.cli.convert import main as lp_convert
from lightning_parallel.testing import run_processes
from tests.integration.convert_sources import (
    LLAMA,
    LP_TRAIN,
    MP_CLASS,
    ground_truth,
    group_names,
    lp_train,
    model_parallel_source,
)
from tests.integration.forked_cli import forked_or_spawned

pytest.importorskip("transformers", reason="pip install -e '.[hf]'")
# Extended (pytest -m extended): making the six real sources takes about 2.5 minutes, over the default suite's budget;
# the conversions themselves are held in the default run by tests/unit/checkpoints (synthetic files of each kind).
pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.timeout(1500)]

TARGETS = ("dcp", "lightning", "pt", "hf")
SOURCES = (*LP_TRAIN, "model_parallel")
NOT_HF = {"ddp_first_look"}  # the GPT recipe: no Hugging Face model to export
# Sources whose files do not record the Hugging Face model (no suite strategy wrote them): --hf-config.
NEED_HF_CONFIG = {"single", "model_parallel"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """``{name: (path, LightningModule class)}`` of every source, and the folder of the tiny Llama's config.json."""
    root = tmp_path_factory.mktemp("convert_sources")
    made = {}
    for name, (_, module_class) in LP_TRAIN.items():
        start = time.perf_counter()
        made[name] = (lp_train(name, root), module_class)
        print(f"{name}: lp-train in {time.perf_counter() - start:.1f}s")
    run_processes(model_parallel_source, 2, str(root), timeout=600)
    made["model_parallel"] = (root / "mp.ckpt", MP_CLASS)
    # Not "llama/": lp-train, run in this folder below, reads model.config=llama as a local folder when one exists.
    (root / "mp_llama_config").mkdir()
    (root / "mp_llama_config" / "config.json").write_text(json.dumps({"model_type": "llama", **LLAMA}))
    return made, root


def _hf_config(name, sources):
    """The ``--hf-config`` a source needs: the recipe's model (exported from the hybrid folder) or the tiny Llama."""
    made, root = sources
    if name == "model_parallel":
        return ["--hf-config", str(root / "mp_llama_config")]
    recipe = root / "recipe_hf"
    if not recipe.exists():
        assert lp_convert([str(made["hybrid"][0]), str(recipe), "--to", "hf"]) == 0
    return ["--hf-config", str(recipe)]


def _convert(src, dst, to, name, sources):
    extra = _hf_config(name, sources) if to == "hf" and name in NEED_HF_CONFIG else []
    code = lp_convert([str(src), str(dst), "--to", to, *extra])
    assert code == 0, f"{name}: {src.name} -> {to} refused"
    return dst


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.equal(torch.as_tensor(a).double(), torch.as_tensor(b).double())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _check(out, to, truth, groups, hf_prefix="model."):
    """``out`` holds exactly the source's weights, and its optimizer state where ``to`` carries one."""
    weights, optimizer = truth
    assert weights and any(key.startswith("state.") for key in optimizer)  # something to compare, moments included
    if to == "hf":
        from safetensors.torch import load_file

        got = {hf_prefix + k: v for k, v in load_file(out / "model.safetensors").items()}
    elif to == "pt":
        got = torch.load(out, weights_only=True)
    else:
        checkpoint = read_lightning_checkpoint(out, groups if to == "lightning" else None)
        got = checkpoint["state_dict"]
        (state,) = checkpoint["optimizer_states"]
        assert state.keys() == optimizer.keys(), sorted(state.keys() ^ optimizer.keys())[:5]
        assert [k for k in state if not _same(state[k], optimizer[k])] == []
    assert got.keys() == weights.keys(), sorted(got.keys() ^ weights.keys())[:5]
    assert [k for k in weights if not torch.equal(got[k], weights[k])] == []
    if to == "lightning":  # Lightning's own fit(ckpt_path=...) loads with weights_only=True and no allow-list
        assert isinstance(torch.load(out, weights_only=True)["hyper_parameters"], dict)


@pytest.mark.parametrize("name", SOURCES)
def test_every_source_converts_to_every_output_and_back_exactly(name, sources, tmp_path):
    made, _ = sources
    path, module_class = made[name]
    truth = ground_truth(path, module_class)
    if name == "model_parallel":  # Lightning's nested groups list the names: the truth is in the folder itself
        groups = read_lightning_checkpoint(path)["lightning_parallel"]["param_groups"]
    else:
        groups = group_names(path, module_class)
    targets = [t for t in TARGETS if not (t == "hf" and name in NOT_HF)]
    seconds = {}
    for to in targets:
        start = time.perf_counter()
        first = _convert(path, tmp_path / f"first.{to}", to, name, sources)
        seconds[to] = time.perf_counter() - start
        _check(first, to, truth, groups)
        if to not in ("dcp", "lightning"):
            continue
        for again in targets:
            _check(_convert(first, tmp_path / f"{to}.then.{again}", again, name, sources), again, truth, groups)
    print(f"{name}: " + ", ".join(f"-> {to} {s:.1f}s" for to, s in seconds.items()))


def test_converted_lightning_files_resume_under_lightning_itself(sources, tmp_path):
    """The README's DDP file rewritten, and a ZeRO-2 folder turned into a Lightning file, resume with lp-train."""
    made, root = sources
    cases = {"ddp_first_look": ["strategy=ddp", "trainer.devices=2"], "zero2": ["strategy=single"]}
    for name, strategy in cases.items():
        converted = tmp_path / f"{name}.ckpt"
        assert lp_convert([str(made[name][0]), str(converted), "--to", "lightning"]) == 0
        model_and_data = [a for a in LP_TRAIN[name][0] if not a.startswith(("strategy", "trainer.devices"))]
        args = [*model_and_data, *strategy, "trainer.max_steps=3", f"ckpt_path={converted}",
                f"hydra.run.dir={tmp_path / name}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}
        run = forked_or_spawned("lightning_parallel.cli.train", [*args], root, env, 600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
        resumed = torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=False)
        assert resumed["global_step"] == 3, name  # 2 steps from the checkpoint, 1 more
