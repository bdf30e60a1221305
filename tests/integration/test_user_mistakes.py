"""A newcomer's mistakes (issue 42): each is refused before any process starts, in one line naming the setting
and the fix (exit code 2 through the command).

Most run in this process through the checks ``lp-train`` runs before it starts a rank, in its order (the command
line, Hydra's composition, preflight, the start checkpoint); a handful run as the ``lp-train`` command (one through
the installed console script), which must print one error line, exit 2, start no rank and leave no run folder.
"""

from pathlib import Path

import pytest
import torch

from lightning_parallel.cli.plan import compose
from tests.integration.entry_point import entry_point_env, run_lp_train, run_lp_train_forked
from tests.integration.forked_cli import run_command
from tests.integration.lp_train_checks import refusal

TINY = ["model=gpt_tiny", "trainer=cpu_test", "logger=none", "callbacks=none"]

# (mistake, overrides after TINY, fragments the one line must hold); {tmp} is the test's folder of files.
MISTAKES = [
    ("group option typo", "strategy=hybird", ["strategy=hybird", "did you mean strategy=hybrid?"]),
    ("experiment typo", "experiment=nlp_gtp", ["did you mean experiment=nlp_gpt?"]),
    ("model option typo", "model=gpt_tny", ["did you mean model=gpt_tiny?"]),
    ("key typo", "strategy=hybrid strategy.tensor_paralel_size=2", ["did you mean strategy.tensor_parallel_size=2?"]),
    ("key of another strategy", "strategy=ddp strategy.microbatches=2",
     ["strategy.microbatches is not a setting of strategy=ddp", "add strategy="]),
    ("nested key typo", "model.optimzer.lr=0.1", ["did you mean model.optimizer.lr=0.1?"]),
    ("data key typo", "data.batchsize=4", ["did you mean data.batch_size=4?"]),
    ("trainer key typo", "trainer.max_step=5", ["did you mean trainer.max_steps=5?"]),
    ("added model argument typo", "+model.dropuot=0.1", ["model.dropuot is not an argument", "model.dropout?"]),
    ("added optimizer argument typo", "+model.optimizer.lrr=1", ["did you mean model.optimizer.lr?"]),
    ("Hydra's '+' on a strategy given by name", "strategy=single +strategy.microbatches=2",
     ["strategy has settings (microbatches) but no _target_"]),
    ("optimizer class typo", "model.optimizer._target_=torch.optim.Adamw", ["cannot be imported"]),
    ("added strategy option typo", "strategy=hybrid trainer.devices=4 +strategy.tensor_paralel_size=2",
     ["tensor_paralel_size", "did you mean 'tensor_parallel_size'?"]),
    ("negative learning rate", "model.optimizer.lr=-0.001", ["model.optimizer.lr=-0.001", "e.g. model.optimizer.lr="]),
    ("zero batch", "data.batch_size=0", ["data.batch_size=0", "give 1 or more"]),
    ("zero accumulation", "trainer.accumulate_grad_batches=0", ["trainer.accumulate_grad_batches=0", "1 or more"]),
    ("micro-batches not dividing the batch", "strategy=pipeline trainer.devices=2 strategy.microbatches=3",
     ["data.batch_size=16", "strategy.microbatches=3", "[1, 2, 4, 8, 16]"]),
    ("schedule typo", "strategy=hybrid strategy.schedule=1f1f", ["did you mean strategy.schedule=1f1b?"]),
    ("compile backend typo", "strategy=hybrid strategy.compile=inductr", ["did you mean strategy.compile=inductor?"]),
    ("no steps", "trainer.max_steps=0", ["trainer.max_steps=0 trains nothing"]),
    ("precision typo", "trainer.precision=bf16mixed", ["did you mean trainer.precision=bf16-mixed?"]),
    ("validation never", "trainer.val_check_interval=0", ["trainer.val_check_interval=0"]),
    ("negative clipping", "trainer.gradient_clip_val=-1", ["trainer.gradient_clip_val=-1 is negative"]),
    ("empty sequences", "data.seq_len=0", ["data.seq_len=0"]),
    ("beta out of range", "model.optimizer.betas=[0.9,1.5]", ["model.optimizer.betas", "[0, 1)"]),
    ("no devices", "trainer.devices=0", ["trainer.devices=0", "positive count"]),
    ("pipeline larger than the world", "strategy=pipeline trainer.devices=2 strategy.pipeline_parallel_size=3",
     ["strategy.pipeline_parallel_size=3", "trainer.devices=2"]),
    ("a GPU that is not there", "trainer.accelerator=gpu", ["no cuda device", "trainer.accelerator=cpu"]),
    ("missing data file", "data.path=no_such_corpus.txt", ["data.path=no_such_corpus.txt does not exist"]),
    ("empty data file", "data.path={tmp}/empty.txt", ["is an empty file"]),
    ("sequence not splitting over context ranks", "strategy=context trainer.devices=2 data.seq_len=130",
     ["data.seq_len=130", "use data.seq_len="]),
    ("global batch out of reach", "scaling=fixed_global_batch scaling.reference.global_batch_size=30 "
     "scaling.reference.lr=0.001", ["scaling.reference.global_batch_size=30", "data.batch_size"]),
    ("fp16 under tensor parallelism", "strategy=tensor trainer.devices=2 trainer.precision=16-mixed",
     ["'16-mixed' is not supported"]),
    ("heads not dividing the width", "model.n_head=3", ["model.n_head=3 must divide model.d_model=32"]),
    ("dropout out of range", "model.dropout=1.5", ["model (", "dropout probability has to be between 0 and 1"]),
    ("pretrained folder that does not exist", "model=hf_causal_lm model.pretrained=/nonexistent",
     ["model.pretrained='/nonexistent'", "config.json"]),
    ("pretrained folder without config.json", "model=hf_causal_lm model.pretrained={tmp}/run",
     ["model.pretrained=", "holds no config.json"]),
    ("missing checkpoint", "ckpt_path=missing.ckpt", ["ckpt_path=missing.ckpt does not exist"]),
    ("truncated checkpoint", "ckpt_path={tmp}/truncated.ckpt", ["ckpt_path=", "truncated or damaged"]),
    ("a file that is no checkpoint", "ckpt_path={tmp}/notes.ckpt", ["is not a checkpoint a run can resume from"]),
    ("another model's checkpoint", "model=gpt ckpt_path={tmp}/run/checkpoints/last.ckpt",
     ["holds another model than this run's GPT", "tensors have another shape", "chose: model=gpt_tiny"]),
    ("last without a checkpoint", "ckpt_path=last", ["ckpt_path=last", "resume=<its folder>"]),
    ("resume of a folder that is no run", "resume={tmp}/nothing_here", ["not a run folder"]),
]
# Through the installed command: exit 2, one line, no rank started, no run folder left.
COMMAND_CASES = ("group option typo", "micro-batches not dividing the batch", "truncated checkpoint")


def _files(folder: Path) -> None:
    """An empty data file, a checkpoint of gpt_tiny in a run folder, a truncated copy, a file that is none."""
    from hydra.utils import instantiate

    (folder / "empty.txt").write_text("")
    (folder / "notes.ckpt").write_text("my notes")
    model = instantiate(compose(TINY).model)
    model.configure_model()
    run = folder / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- model=gpt_tiny\n- trainer.max_steps=2\n")
    (run / "checkpoints").mkdir()
    checkpoint = run / "checkpoints" / "last.ckpt"
    torch.save({"pytorch-lightning_version": "2.6.6", "global_step": 2, "state_dict": model.state_dict()}, checkpoint)
    (folder / "truncated.ckpt").write_bytes(checkpoint.read_bytes()[:4000])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistakes")
    _files(folder)
    return folder


@pytest.mark.parametrize(("name", "overrides", "fragments"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistake_is_refused_in_one_line_naming_the_setting_and_fix(name, overrides, fragments, files, tmp_path):
    line = refusal([*TINY, *overrides.format(tmp=files).split()], tmp_path / "run")
    assert line, f"{name}: not refused"
    for fragment in fragments:
        assert fragment.format(tmp=files) in line, f"{name}: {fragment!r} missing from {line!r}"
    assert "Error in call to target" not in line and "Traceback" not in line
    assert len(line.splitlines()) <= 2, line


def test_the_list_holds_at_least_25_mistakes_and_the_recipe_itself_passes(files, tmp_path):
    assert len(MISTAKES) >= 25
    assert refusal(TINY, tmp_path / "run") == ""
    assert refusal([*TINY, f"ckpt_path={files}/run/checkpoints/last.ckpt"], tmp_path / "run") == ""
    assert refusal([*TINY, "strategy=pipeline", "trainer.devices=2", "strategy.microbatches=4"], tmp_path / "r") == ""


def _lp_train(name: str, args: list[str], cwd: Path) -> tuple[int, str]:
    # The last case through the installed console script (a new interpreter: import-time output would show), the
    # others as the same command forked from the fork server.
    return (run_lp_train if name == COMMAND_CASES[-1] else run_lp_train_forked)(args, cwd)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_through_the_command_a_mistake_exits_2_in_one_line_before_any_rank_and_leaves_no_run_folder(files, tmp_path):
    cases = {name: (overrides, fragments) for name, overrides, fragments in MISTAKES if name in COMMAND_CASES}
    assert len(cases) == len(COMMAND_CASES)
    for name, (overrides, fragments) in cases.items():
        code, output = _lp_train(name, [*TINY, *overrides.format(tmp=files).split()], tmp_path)
        assert code == 2, f"{name}: exit {code}\n{output[-3000:]}"
        errors = [line for line in output.splitlines() if line.startswith("lp-train: error: ")]
        assert len(errors) == 1, f"{name}:\n{output[-3000:]}"
        assert all(fragment.format(tmp=files) in output for fragment in fragments), f"{name}:\n{output}"
        for started in ("Initializing distributed", "Seed set", "Traceback", "Error in call to target"):
            assert started not in output, f"{name}: {started!r}\n{output[-3000:]}"
    assert not list(tmp_path.glob("outputs/*/*")), "a refused run left a run folder"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks", ["[0,1]", "[1]"], ids=["every rank fails", "rank 1 alone fails"])
def test_an_error_only_a_running_rank_meets_is_shown_once_as_its_root_cause(ranks, tmp_path):
    from tests.integration.failing_model import CAUSE

    args = [*TINY, "trainer.devices=2", "trainer.max_steps=2",
            "model._target_=tests.integration.failing_model.FailingGPT", f"+model.fail_on_ranks={ranks}"]
    env = {**entry_point_env(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # the ranks import the model
    # lp-train forked from the fork server (it forks its rank 1 as the installed command does on CPU)
    done = run_command("lightning_parallel.cli.train", args, tmp_path, env, 300, merge_stderr=True)
    output = done.stdout
    assert done.returncode != 0, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("lp-train: error")]
    assert len(errors) == 1, output[-3000:]  # once, not once per rank
    assert errors[0].endswith(f"ValueError: {CAUSE}"), errors  # the cause, not Hydra's wrapper
    assert "Error in call to target" not in output and "Traceback" not in output, output[-3000:]
    logs = list(tmp_path.glob("outputs/*/*/train.log")) + list(tmp_path.glob("outputs/*/*/rank1.log"))
    assert any("Error in call to target" in log.read_text() for log in logs)  # the full traceback stays in the log
