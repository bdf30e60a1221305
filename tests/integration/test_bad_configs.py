"""Bad configurations through ``lp-train``: one short message with its remedy, before any rank starts (issue 22).

The cases the layout checks do not cover (those are in test_layout_errors.py): unknown Trainer keys,
an accelerator the machine lacks, a missing data path, resume and checkpoint mistakes, a folder that
belongs to another run. Every case runs through the entry point's ``main()`` in one helper process (the
import is the slow part); two also run as the ``lp-train`` command, one of them through the installed console
script.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.entry_point import run_cases_in_one_process, run_lp_train, run_lp_train_forked

pytestmark = pytest.mark.slow

TINY = ["model=gpt_tiny", "trainer=cpu_test", "trainer.max_steps=1", "logger=none", "callbacks=none", "strategy=single"]

# (case, overrides, what the message must contain, its remedy); {tmp} is the test's folder.
CASES = [
    ("max_step_typo", "trainer.max_step=5", ["trainer.max_step is not a Trainer argument"],
     "did you mean trainer.max_steps=5?"),
    ("max_step_appended", "+trainer.max_step=5", ["trainer.max_step is not a Trainer argument"],
     "did you mean trainer.max_steps=5?"),
    ("accelerator_typo", "trainer.acelerator=cpu", ["trainer.acelerator"], "did you mean trainer.accelerator=cpu?"),
    ("gpu_without_cuda", "trainer.accelerator=gpu", ["trainer.accelerator=gpu", "no cuda device"],
     "use trainer.accelerator=cpu"),
    ("unknown_accelerator", "trainer.accelerator=quantum", ["trainer.accelerator=quantum"],
     "cpu, cuda, mps, tpu, auto"),
    ("missing_data_path", "data.path=no_such_corpus", ["data.path=no_such_corpus does not exist"], "or data.path=null"),
    ("last_without_checkpoint", "ckpt_path=last", ["ckpt_path=last", "holds no last*.ckpt"],
     "continue an earlier run with resume=<its folder>"),
    ("missing_checkpoint", "ckpt_path=missing.ckpt", ["ckpt_path=missing.ckpt does not exist"], "resume=<run folder>"),
    ("run_folder_as_checkpoint", "ckpt_path={tmp}/old_run", ["ckpt_path={tmp}/old_run is a run folder"],
     "continue it with resume={tmp}/old_run"),
    ("resume_not_a_run", "resume={tmp}/nothing_here", ["resume={tmp}/nothing_here: not a run folder"],
     "give a folder lp-train made"),
    ("fp16_under_tensor", "strategy=tensor trainer.devices=2 trainer.precision=16-mixed",
     ["precision='16-mixed' is not supported"], "use 'bf16-mixed'"),
    ("another_runs_folder", "hydra.run.dir={tmp}/old_run", ["{tmp}/old_run already holds run abc123"],
     "continue that run with resume={tmp}/old_run"),
]
CLI_CASES = ("max_step_typo", "gpu_without_cuda")


def _old_run(tmp_path):
    """A folder another run owns (its .lp/run.json and .hydra/), as lp-train leaves one."""
    folder = tmp_path / "old_run"
    (folder / ".lp").mkdir(parents=True)
    (folder / ".hydra").mkdir()
    (folder / ".lp" / "run.json").write_text(json.dumps({"run_id": "abc123", "started": "2026-01-01 10:00:00"}))


def _args(overrides, tmp_path):
    return [*TINY, *overrides.format(tmp=tmp_path).split()]


def _in_process(tmp_path):
    return run_cases_in_one_process([(name, _args(over, tmp_path)) for name, over, _, _ in CASES], tmp_path)


def _lp_train(name, overrides, tmp_path):
    # The last through the installed console script (a new interpreter, which asks for CUDA afresh), the other as
    # the same command forked from the fork server.
    run = run_lp_train if name == CLI_CASES[-1] else run_lp_train_forked
    return run(_args(overrides, tmp_path), tmp_path)


def _assert_one_short_error(name, code, output, fragments, remedy):
    assert code == 2, f"{name}: exit {code}\n{output[-3000:]}"
    lines = [line for line in output.splitlines() if line.startswith("lp-train: error: ")]
    assert len(lines) == 1, f"{name}: expected one error line\n{output[-3000:]}"
    message = output[output.index(lines[0]):]
    for text in (*fragments, remedy):
        assert text in message, f"{name}: {text!r} missing from {message!r}"
    assert "Traceback" not in output and "Error executing job" not in output, f"{name}:\n{output[-3000:]}"
    assert "Seed set" not in output and "Initializing distributed" not in output, f"{name}: a rank started\n{output}"


@pytest.mark.timeout(420)
def test_bad_configs_fail_once_with_a_remedy_before_any_rank_starts(tmp_path):
    assert len(CASES) >= 10
    _old_run(tmp_path)
    expected = {
        name: ([f.format(tmp=tmp_path) for f in frags], remedy.format(tmp=tmp_path)) for name, _, frags, remedy in CASES
    }
    overrides = {name: over for name, over, _, _ in CASES}
    with ThreadPoolExecutor(max_workers=len(CLI_CASES) + 1) as pool:
        in_process = pool.submit(_in_process, tmp_path)
        cli = {name: pool.submit(_lp_train, name, overrides[name], tmp_path) for name in CLI_CASES}
        results = {name: future.result() for name, future in cli.items()}
        outputs = in_process.result()
    for name, (code, output) in outputs.items():
        _assert_one_short_error(name, code, output, *expected[name])
    for name, (code, output) in results.items():
        _assert_one_short_error(f"lp-train {name}", code, output, *expected[name])
    # The other run's folder is untouched, and no refused run claimed a folder or trained.
    assert json.loads((tmp_path / "old_run" / ".lp" / "run.json").read_text())["run_id"] == "abc123"
    assert not list((tmp_path / "old_run" / ".hydra").iterdir())  # Hydra's files of the refused run went elsewhere
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.glob("outputs/*/*/.lp"))
