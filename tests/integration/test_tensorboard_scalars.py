"""What a run's TensorBoard folder holds: per-step throughput, the global gradient norm, memory per rank, the
pipeline bubble, and the final figures beside the hyperparameters, in one event file."""

from pathlib import Path

import pytest

from tests.integration.lp_train_runs import logged_scalars, lp_train, ok

pytestmark = pytest.mark.slow

STEPS = 2
TINY = ["model=gpt_tiny", "trainer=cpu_test", "data.seq_len=32", "data.max_bytes=200000",
        "trainer.limit_val_batches=1", "trainer.val_check_interval=2", "callbacks.evaluation=null",
        f"trainer.max_steps={STEPS}", f"model.max_steps={STEPS}"]
PIPELINE2 = ["strategy=hybrid", "strategy.pipeline_parallel_size=2", "strategy.tensor_parallel_size=1",
             "strategy.microbatches=2", "trainer.devices=2", "data.batch_size=4"]


def test_a_two_step_pipelined_run_logs_throughput_grad_norm_and_memory_of_every_rank_in_one_event_file(tmp_path):
    out = ok(lp_train([*TINY, *PIPELINE2, "hydra.run.dir=run"], tmp_path, timeout=400))
    board = tmp_path / "run" / "tensorboard"
    assert len(list(board.glob("events.out.tfevents.*"))) == 1, sorted(p.name for p in board.iterdir())

    steps = list(range(1, STEPS + 1))
    samples = logged_scalars(board, "throughput/step_samples_per_sec")
    tokens = logged_scalars(board, "throughput/step_tokens_per_sec")
    assert sorted(samples) == steps and all(v > 0 for v in samples.values())
    # Every token of a sample is counted: 32 tokens a sample (the pipeline's 2 ranks hold one data replica).
    assert all(tokens[s] == pytest.approx(32 * samples[s], rel=1e-6) for s in steps)

    norms = logged_scalars(board, "grad_norm")  # the clipping's own global norm (gradient_clip_val=1.0)
    assert sorted(norms) == steps and all(0 < v < 1e3 for v in norms.values())

    rss = logged_scalars(board, "memory/max_rss_mib")
    assert sorted(rss) == steps and all(v > 100 for v in rss.values())  # a rank with torch loaded
    per_rank = [logged_scalars(board, f"memory/rank{r}/max_rss_mib") for r in (0, 1)]
    assert all(list(p) == [STEPS] and p[STEPS] > 100 for p in per_rank)
    assert per_rank[0][STEPS] >= rss[STEPS]  # rank 0's peak at the end is no lower than during training

    # The pipeline bubble, measured on every rank: 2 stages, 2 micro-batches, ideal (p-1)/(m+p-1) = 1/3.
    assert logged_scalars(board, "pipeline/bubble_ideal") == {0: pytest.approx(1 / 3)}
    idle = logged_scalars(board, "pipeline/idle_fraction")
    assert sorted(idle) == steps and all(0 < v < 1 for v in idle.values())
    for rank in (0, 1):
        assert 0 < logged_scalars(board, f"pipeline/rank{rank}/idle_fraction")[STEPS] < 1

    assert logged_scalars(board, "hp/val_loss")  # the final figures reach the HParams tab in the same file
    table = out[out.index("lightning_parallel: result"):]
    assert "nan" not in table.lower()


def test_log_final_hparams_and_per_step_scalars_leave_one_event_file_on_one_process(tmp_path):
    ok(lp_train([*TINY, "strategy=single", "data.batch_size=4", "hydra.run.dir=run"], tmp_path))
    board = Path(tmp_path) / "run" / "tensorboard"
    assert len(list(board.glob("events.out.tfevents.*"))) == 1
    assert sorted(logged_scalars(board, "throughput/step_samples_per_sec")) == [1, 2]
    assert list(logged_scalars(board, "memory/rank0/max_rss_mib")) == [STEPS]
    # Lightning's single-device strategy clips with torch's own norm, which it does not keep: no grad_norm there.
    assert logged_scalars(board, "grad_norm") == {}
    assert logged_scalars(board, "pipeline/idle_fraction") == {}  # no pipeline, no bubble scalar
