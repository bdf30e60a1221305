"""Invalid layouts through the entry point: one clean error line naming the user's settings and a fix.

Every case runs through ``lightning_parallel.cli.train.main`` (Hydra compose, preflight, exit code) in
one helper process, since each error comes before any rank starts; the issue's three cases also
run as the ``lp-train`` command (the first through the installed console script). No case may start a
process or a step: a layout that was wrongly accepted would train (``trainer.max_steps=1``) and fail the assertions.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.entry_point import run_cases_in_one_process, run_lp_train, run_lp_train_forked

pytestmark = pytest.mark.slow

TINY = ["model=gpt_tiny", "trainer=cpu_test", "trainer.max_steps=1", "logger=none", "callbacks=none"]

# (case, overrides, what the message must contain: the user's settings and values, then a remedy)
CASES = [
    ("hybrid_pp3_on_4", "strategy=hybrid trainer.devices=4 strategy.pipeline_parallel_size=3",
     ["strategy.pipeline_parallel_size=3", "strategy.tensor_parallel_size=2", "trainer.devices=4", "4 processes"],
     "Fix: sizes whose product divides 4"),
    ("tensor_tp3_on_2", "strategy=tensor trainer.devices=2 strategy.tensor_parallel_size=3",
     ["strategy.tensor_parallel_size=3", "trainer.devices=2", "2 processes"], "(trainer.devices=3)"),
    ("pipeline_pp8_on_2", "strategy=pipeline trainer.devices=2 strategy.pipeline_parallel_size=8",
     ["strategy.pipeline_parallel_size=8", "trainer.devices=2", "2 processes"], "(trainer.devices=8)"),
    ("two_autos", "strategy=hybrid trainer.devices=4 strategy.pipeline_parallel_size=auto",
     ["strategy.data_parallel_size='auto'", "strategy.pipeline_parallel_size='auto'", "trainer.devices=4"],
     "give strategy.pipeline_parallel_size an explicit size (a divisor of 4: 1, 2, 4)"),
    ("size_zero", "strategy=tensor trainer.devices=2 strategy.tensor_parallel_size=0",
     ["strategy.tensor_parallel_size=0"], "pass a positive integer"),
    ("size_not_integer", "strategy=tensor trainer.devices=2 strategy.tensor_parallel_size=1.5",
     ["strategy.tensor_parallel_size=1.5"], "pass a positive integer"),
    ("tp3_vs_4_heads", "strategy=tensor trainer.devices=3 strategy.tensor_parallel_size=3",
     ["strategy.tensor_parallel_size=3", "4 heads"], "Sizes that divide every sharded dimension: 1, 2, 4"),
    ("zero_stage_1_on_hybrid", "strategy=hybrid trainer.devices=4 strategy.zero_stage=1",
     ["strategy.zero_stage=1"], "strategy=deepspeed_zero1"),
    ("loss_parallel_without_tp", "strategy=hybrid trainer.devices=2 strategy.pipeline_parallel_size=2 "
     "strategy.tensor_parallel_size=1 strategy.loss_parallel=true",
     ["strategy.loss_parallel=True", "strategy.tensor_parallel_size=1"], "set strategy.tensor_parallel_size >= 2"),
    ("interleaved_one_stage_per_rank", "strategy=pipeline trainer.devices=2 strategy.schedule=interleaved_1f1b",
     ["strategy.schedule='interleaved_1f1b'", "strategy.stages_per_rank=1"], "set strategy.stages_per_rank >= 2"),
    ("more_stages_than_layers", "strategy=pipeline trainer.devices=2 strategy.schedule=interleaved_1f1b "
     "strategy.stages_per_rank=4", ["strategy.pipeline_parallel_size=2", "strategy.stages_per_rank=4", "8 stages"],
     "strategy.stages_per_rank <= 2"),
    ("too_few_microbatches", "strategy=pipeline trainer.devices=2 strategy.microbatches=1",
     ["strategy.microbatches=1", "strategy.pipeline_parallel_size=2"], "Fix: strategy.microbatches >= 2"),
    ("devices_not_a_count", "strategy=ddp trainer.devices=auto",
     ["trainer.devices='auto'"], "e.g. trainer.devices=2"),
    ("nodes_without_launcher", "strategy=ddp trainer.devices=2 trainer.num_nodes=2",
     ["trainer.num_nodes=2"], "run under torchrun"),
    # context parallelism: every refusal names the setting or method that works
    ("context_cp3_on_4", "strategy=context trainer.devices=4 strategy.context_parallel_size=3",
     ["strategy.context_parallel_size=3", "trainer.devices=4"], "Fix: strategy.context_parallel_size among 1, 2, 4"),
    ("context_sequence_not_divisible", "strategy=context trainer.devices=4 strategy.context_parallel_size=4 "
     "data.seq_len=20", ["data.seq_len=20", "strategy.context_parallel_size=4"], "use data.seq_len=16 or 24"),
    ("context_ulysses_heads", "strategy=context trainer.devices=4 strategy.context_parallel_size=2 "
     "strategy.tensor_parallel_size=2 strategy.data_parallel_size=1 strategy.context_parallel_method=ulysses "
     "model.n_head=2", ["context_parallel_method='ulysses'", "context_parallel_size=2"],
     "context_parallel_method='ring', which has no head constraint"),
    ("context_unknown_method", "strategy=context trainer.devices=2 strategy.context_parallel_method=flash",
     ["strategy.context_parallel_method='flash'"], "use 'ring' (any head count) or 'ulysses'"),
    ("context_on_vit", "strategy=context trainer.devices=2 model=vit data=digits",
     ["context_parallel_plan()"], "or set strategy.context_parallel_size=1"),
]
ISSUE_CASES = ("hybrid_pp3_on_4", "tensor_tp3_on_2", "pipeline_pp8_on_2")


def _args(overrides, run_dir):
    return [*TINY, *overrides.split(), f"hydra.run.dir={run_dir}"]


def _in_process(tmp_path):
    return run_cases_in_one_process([(name, _args(over, tmp_path / name)) for name, over, _, _ in CASES], tmp_path)


def _lp_train(name, overrides, tmp_path):
    # The first through the installed console script (a new interpreter, import-time output included), the others
    # as the same command forked from the fork server (seconds of imports less each).
    run = run_lp_train if name == ISSUE_CASES[0] else run_lp_train_forked
    return run(_args(overrides, tmp_path / f"cli_{name}"), tmp_path)


def _assert_one_clean_error(name, code, output, settings, remedy):
    assert code == 2, f"{name}: exit {code}\n{output[-3000:]}"
    lines = [line for line in output.splitlines() if line.startswith("lp-train: error: ")]
    assert len(lines) == 1, f"{name}: expected one error line\n{output[-3000:]}"
    message = lines[0]
    assert output.count(message[len("lp-train: error: "):]) == 1, f"{name}: message printed twice\n{output}"
    assert "Traceback" not in output, f"{name}: traceback instead of a clean message\n{output[-3000:]}"
    for setting in settings:
        assert setting in message, f"{name}: {setting!r} missing from {message!r}"
    assert remedy in message, f"{name}: remedy {remedy!r} missing from {message!r}"


@pytest.mark.timeout(420)
def test_invalid_layouts_fail_once_naming_the_settings_the_world_and_a_fix(tmp_path):
    assert len(CASES) >= 10
    expected = {name: (settings, remedy) for name, _, settings, remedy in CASES}
    with ThreadPoolExecutor(max_workers=len(ISSUE_CASES) + 1) as pool:
        in_process = pool.submit(_in_process, tmp_path)
        cli = {name: pool.submit(_lp_train, name, over, tmp_path) for name, over, _, _ in CASES if name in ISSUE_CASES}
        results = {name: future.result() for name, future in cli.items()}
        outputs = in_process.result()
    for name, (code, output) in outputs.items():
        _assert_one_clean_error(name, code, output, *expected[name])
    for name, (code, output) in results.items():
        _assert_one_clean_error(f"lp-train {name}", code, output, *expected[name])
    # Nothing was launched or trained: no rank folders, no checkpoints.
    assert not list(tmp_path.rglob("*.ckpt")) and not list(tmp_path.rglob(".lp"))
