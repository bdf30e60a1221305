"""lp-simulate: lp-train's configuration and refusals, a table, simulation.json."""

import json

import pytest

from lightning_parallel.cli.simulate import main

GPT = ["experiment=nlp_gpt", "model=gpt_tiny", "strategy=hybrid", "trainer.devices=4"]


def test_help_describes_the_command_with_examples(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    text = capsys.readouterr().out
    assert done.value.code == 0
    assert "rank class" in text and "lp-simulate experiment=nlp_gpt" in text and "cluster=" in text


def test_a_layout_lp_train_refuses_is_refused_with_its_message_and_exit_code_2(capsys):
    from lightning_parallel.cli.plan import compose
    from lightning_parallel.cli.preflight import ConfigError, preflight

    bad = [*GPT, "strategy.pipeline_parallel_size=3"]
    with pytest.raises(ConfigError) as refused:
        preflight(compose(bad))
    with pytest.raises(SystemExit) as done:
        main(bad)
    assert done.value.code == 2
    assert capsys.readouterr().err.strip() == f"lp-simulate: error: {refused.value}"


def test_a_run_prints_one_row_per_class_and_writes_simulation_json(tmp_path, capsys):
    main([*GPT, "strategy.pipeline_parallel_size=2", "strategy.tensor_parallel_size=1", "strategy.zero_stage=3",
          "cluster=h100_node", "--out", str(tmp_path)])
    found = json.loads((tmp_path / "simulation.json").read_text())
    out = capsys.readouterr().out

    assert found["world_size"] == 4 and found["fits"] is True and len(found["classes"]) == 2
    assert found["settings"]["cluster"] == "h100_node"
    assert "dp2 x pp2 x tp1" in out and "class 1 (2 ranks): pipeline position 1" in out and "fits" in out


def test_lp_plan_simulate_shows_predicted_and_simulated_memory_side_by_side(capsys):
    from lightning_parallel.cli.plan import main as lp_plan

    lp_plan(["experiment=nlp_gpt", "model=gpt_tiny", "trainer.devices=2", "--top", "2", "--simulate", "2",
             "--no-deepspeed"])
    out = capsys.readouterr().out
    assert "predicted and simulated memory" in out and "simulated" in out and "fits by simulation" in out


def test_a_config_json_folder_is_the_model_and_its_step_is_measured(tmp_path, capsys):
    """A Hugging Face decoder given as a local ``config.json`` folder (nothing downloads): its shapes are built on
    meta, and one step of ``data.batch_size`` x ``data.seq_len`` reports activations and each class's collectives."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "tiny-llama"
    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, max_position_embeddings=64).save_pretrained(folder)
    main(["model=hf_causal_lm", f"model.config={folder}", "data=text_padded", "data.seq_len=32", "data.batch_size=2",
          "strategy=hybrid", "trainer.devices=4", "strategy.pipeline_parallel_size=1",
          "strategy.tensor_parallel_size=2", "strategy.zero_stage=3", "--out", str(tmp_path / "out")])
    found = json.loads((tmp_path / "out" / "simulation.json").read_text())
    out = capsys.readouterr().out

    (only,) = found["classes"]
    assert only["activation_bytes"] > 0 and only["peak_bytes"] > only["parameter_bytes"] + only["activation_bytes"]
    kinds = {(c["kind"], c["axis"]) for c in only["collectives"]}
    assert {("all_gather", "data_parallel"), ("reduce_scatter", "data_parallel"),
            ("all_reduce", "tensor_parallel")} <= kinds
    assert "step collectives" in out and "activations measured" in out


def test_torchrec_is_simulated_from_its_planners_plan(tmp_path, capsys):
    """strategy=torchrec (experiment=recsys_torchrec: 8 tables of 262,144 x 64, table-wise) on 4 ranks: each rank
    holds two whole tables and their fused Adagrad sums, beside the replicated dense part."""
    pytest.importorskip("torchrec")
    pytest.importorskip("fbgemm_gpu")
    main(["experiment=recsys_torchrec", "trainer.devices=4", "--out", str(tmp_path)])
    found = json.loads((tmp_path / "simulation.json").read_text())

    (only,) = found["classes"]
    tables = 2 * 262144 * 64 * 4
    dense = only["details"]["dense_parameter_bytes"]
    assert only["ranks"] == [0, 1, 2, 3] and found["elements_checked"] == 8 * 262144 * 64
    assert only["parameter_bytes"] == tables + dense and only["gradient_bytes"] == dense
    assert only["optimizer_bytes"] > tables  # the fused sums, and Adam's state on the dense part
    assert "TorchRec" in capsys.readouterr().out


def test_deepspeed_is_simulated_by_its_partition_arithmetic_and_offloading_is_refused(tmp_path, capsys):
    main(["experiment=nlp_gpt", "model=gpt_tiny", "strategy=deepspeed_zero2", "trainer.devices=4", "--out",
          str(tmp_path)])
    found = json.loads((tmp_path / "simulation.json").read_text())
    (only,) = found["classes"]
    assert found["settings"]["zero_stage"] == 2 and only["ranks"] == [0, 1, 2, 3]
    assert only["gradient_bytes"] * 4 <= only["parameter_bytes"] + 32  # a quarter of the flat buffer (padding aside)
    assert "partition arithmetic" in capsys.readouterr().out

    with pytest.raises(SystemExit) as done:
        main(["experiment=nlp_gpt", "model=gpt_tiny", "strategy=deepspeed_zero3_offload", "trainer.devices=4"])
    assert done.value.code == 2 and "offloading" in capsys.readouterr().err
