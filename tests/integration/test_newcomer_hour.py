"""A newcomer's first hour, played from the README: each command on the outputs of the one before, all exit 0.

The README's order, shrunk to the tiny configs (``model=gpt_tiny``, ``trainer=cpu_test``, a few steps): the first
look (the hybrid strategy, pipeline 2) -> ``lp-convert`` of its checkpoint to every target (the suite's DCP folder,
a Lightning file, a plain ``state_dict``) and the Lightning file back to the suite's folder -> ``lp-compare`` ->
``lp-plan`` -> a resume from the converted-back checkpoint and ``resume=<run folder>``. Hugging Face: the README's
``model=hf_causal_lm`` trained, exported with ``--to hf`` and fine-tuned again from that folder
(``model.pretrained=``), which is the way back from a ``save_pretrained`` folder.
"""

import time
from pathlib import Path

import pytest
import torch

from lightning_parallel.cli.convert import main as lp_convert
from tests.integration.forked_cli import forked_or_spawned
from tests.integration.lp_train_runs import logged_scalars, lp_train_env, ok

pytestmark = pytest.mark.slow

TINY = ["model=gpt_tiny", "trainer=cpu_test", "data.seq_len=32", "data.max_bytes=200000",
        "trainer.limit_val_batches=1", "callbacks.evaluation=null", "trainer.val_check_interval=2"]
FIRST_LOOK = ["strategy=hybrid", "strategy.pipeline_parallel_size=2", "strategy.tensor_parallel_size=1",
              "trainer.devices=2", "strategy.microbatches=2", "data.batch_size=4"]
HF = ["model=hf_causal_lm", "data=text_padded", "trainer=cpu_test", "data.seq_len=32", "data.batch_size=2",
      "data.max_bytes=50000", "data.max_val_batches=1", "callbacks.evaluation=null", "trainer.max_steps=2",
      "trainer.val_check_interval=2"]


def _run(command: str, args: list[str], cwd: Path, timeout: float = 300) -> str:
    """``lp-<command> *args`` as the README runs it (the module behind the console script), asserting exit 0; its
    wall time is printed (``pytest -s``)."""
    start = time.perf_counter()
    result = forked_or_spawned(f"lightning_parallel.cli.{command}", [*args], cwd, lp_train_env(), timeout)
    print(f"lp-{command} {' '.join(args)[:90]}: {time.perf_counter() - start:.1f} s")
    return ok(result)


def _convert(src: Path, dst: Path, *extra: str) -> None:
    """``lp-convert SRC DST ...``, in this process (the console script's own ``main``): exit code 0."""
    assert lp_convert([str(src), str(dst), *extra]) == 0


def _steps(run: Path) -> list[int]:
    return sorted(logged_scalars(run / "tensorboard", "train_loss"))


def test_the_readme_commands_in_order_each_on_the_previous_outputs_all_exit_0(tmp_path):
    # 1. The first look: the suite's own strategy, 4 steps.
    out = _run("train", [*TINY, *FIRST_LOOK, "trainer.max_steps=4", "model.max_steps=4", "hydra.run.dir=run"],
               tmp_path)
    assert "dp1 x pp2 x tp1" in out and "lightning_parallel: result" in out
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert last.is_dir()  # the suite's DCP folder

    # 2. lp-convert to every target of a GPT checkpoint, and the Lightning file back to the suite's folder.
    _convert(last, tmp_path / "model.pt")
    _convert(last, tmp_path / "model.ckpt", "--to", "lightning")
    _convert(last, tmp_path / "copy.ckpt", "--to", "dcp")
    _convert(tmp_path / "model.ckpt", tmp_path / "back.ckpt", "--to", "dcp")
    weights = torch.load(tmp_path / "model.pt", weights_only=True)
    lightning = torch.load(tmp_path / "model.ckpt", weights_only=False)
    assert weights.keys() == lightning["state_dict"].keys()
    assert all(torch.equal(weights[name], lightning["state_dict"][name]) for name in weights)
    assert lightning["global_step"] == 4 and (tmp_path / "back.ckpt").is_dir()

    # 3. lp-compare: the same batches under two layouts, step by step.
    out = _run("compare", ["experiment=nlp_gpt", "model=gpt_tiny", "data.seq_len=16", "data.max_bytes=200000",
                           "compare.layouts=[single:1,pipeline:2]", "compare.steps=2", "hydra.run.dir=compare"],
               tmp_path)
    assert "layouts agree" in out

    # 4. lp-plan: every layout ranked before anything runs.
    out = _run("plan", ["model=gpt_tiny", "trainer.devices=4"], tmp_path)
    assert "lp-plan: GPT on 4 x cpu" in out

    # 5. Resume: from the converted-back checkpoint in a new run, and the first look's own folder.
    _run("train", [*TINY, *FIRST_LOOK, "trainer.max_steps=6", "model.max_steps=6", f"ckpt_path={tmp_path}/back.ckpt",
                   "hydra.run.dir=from_back"], tmp_path)
    assert _steps(tmp_path / "from_back") == [4, 5]  # the 5th and 6th steps (TensorBoard counts from 0)
    _run("train", [f"resume={tmp_path / 'run'}", "trainer.max_steps=6", "model.max_steps=6"], tmp_path)
    assert _steps(tmp_path / "run") == [0, 1, 2, 3, 4, 5]


def test_a_hugging_face_model_goes_out_to_a_save_pretrained_folder_and_trains_on_from_it(tmp_path):
    pytest.importorskip("transformers", reason="pip install -e '.[hf]'")
    # The suite's strategies record which Hugging Face model a checkpoint holds (Lightning's own do not).
    _run("train", [*HF, "strategy=hybrid", "trainer.devices=2", "strategy.tensor_parallel_size=1",
                   "strategy.microbatches=2", "hydra.run.dir=hf"], tmp_path)
    _convert(tmp_path / "hf" / "checkpoints" / "last.ckpt", tmp_path / "hf_model", "--to", "hf")
    assert (tmp_path / "hf_model" / "config.json").is_file()
    out = _run("train", [*HF, "strategy=single", f"model.pretrained={tmp_path / 'hf_model'}", "hydra.run.dir=from_hf"],
               tmp_path)
    assert "lightning_parallel: result" in out
