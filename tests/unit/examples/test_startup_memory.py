"""The start-up table's model rows: how the run builds the recipe, and the bytes a rank is expected to hold."""

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from examples.nlp.model import GPT
from lightning_parallel.cli.preflight import preflight
from lightning_parallel.cli.report import layout_candidate, model_rows
from lightning_parallel.cli.train import CONFIG_DIR
from lightning_parallel.planner.from_config import expected_state_bytes, state_shape
from lightning_parallel.planner.profile import profile_module


def _compose(*overrides):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("config", overrides=[*overrides, "model=gpt_tiny", "paths.output_dir=/tmp/lp-startup-test"])


def test_the_shape_from_a_meta_model_is_the_planners_measured_one():
    torch.manual_seed(0)
    model = GPT(vocab_size=64, seq_len=16, d_model=32, n_layer=3, n_head=4).build()
    measured = profile_module(model, torch.randint(0, 64, (2, 16)))
    with torch.device("meta"):
        meta = GPT(vocab_size=64, seq_len=16, d_model=32, n_layer=3, n_head=4).build()
    shape = state_shape(meta, pipelined=True)
    assert [layer.params for layer in shape.layers] == [layer.params for layer in measured.layers]
    assert state_shape(meta, pipelined=False).num_params == sum(p.numel() for p in model.parameters())


def test_a_tied_parameter_counts_once():
    pytest.importorskip("transformers")
    from examples.nlp.hf_causal_lm import HFCausalLM

    with torch.device("meta"):
        module = HFCausalLM("qwen2").build()
    assert state_shape(module, pipelined=False).num_params == sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize(
    ("overrides", "build", "divisor"),
    [
        (("strategy=ddp",), "configure_model with storage", 1),
        (("strategy=tensor", "trainer.devices=2"), "configure_model on meta", None),
        (("strategy=pipeline", "trainer.devices=2"), "configure_model on meta", None),
        (("strategy=deepspeed_zero3",), "deepspeed.zero.Init", 2),
    ],
)
def test_rows_say_how_the_model_is_built_and_what_a_rank_holds(overrides, build, divisor):
    cfg = _compose(*overrides)
    strategy, layout = preflight(cfg)
    rows = model_rows(cfg, strategy, layout)
    assert build in rows["model build"] and "setup peak" in rows["memory / rank"]
    with torch.device("meta"):
        module = GPT(**{k: cfg.model[k] for k in ("vocab_size", "seq_len", "d_model", "n_layer", "n_head")}).build()
    candidate, _ = layout_candidate(strategy, layout)
    params, grads, optim = expected_state_bytes(state_shape(module, candidate.pp > 1), candidate)
    full = 4 * sum(p.numel() for p in module.parameters())
    tensors = len(list(module.parameters()))  # AdamW's 4-byte step counter per tensor the rank holds
    assert 2 * params <= optim <= 2 * params + 4 * tensors and grads == params  # AdamW, fp32
    if divisor is not None:
        assert params == pytest.approx(full / divisor, rel=1e-3)
    else:
        assert full / 2 <= params < full  # a stage or a tensor shard: about half, never all
    assert f"parameters {params / 2**10:.2f} KiB" in rows["memory / rank"]


def test_a_model_the_table_cannot_build_gets_one_row_saying_why():
    # preflight itself now refuses an argument the model does not take; the table must still cope with a model that
    # cannot be built (one it is handed after preflight), so the argument is added after preflight ran.
    cfg = _compose("strategy=ddp")
    strategy, layout = preflight(cfg)
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.model.no_such_argument = 1
    rows = model_rows(cfg, strategy, layout)
    assert list(rows) == ["memory / rank"] and rows["memory / rank"].startswith("not estimated")
