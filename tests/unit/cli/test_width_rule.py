"""scaling=mup (scaling.width_rule with model.base_width): what lp-train refuses before any process starts, and what
the run records (lightning_parallel/cli/effective.py, lightning_parallel/scaling.py)."""

import pytest

from lightning_parallel.cli.effective import apply_scaling, reproduce_overrides
from lightning_parallel.cli.plan import compose
from lightning_parallel.cli.preflight import ConfigError, preflight
from lightning_parallel.cli.report import scaling_rows

BASE = ["model=gpt_tiny", "trainer=cpu_test", "logger=none", "callbacks=none", "trainer.devices=1", "strategy=single"]


def _preflight(*overrides):
    cfg = compose([*BASE, *overrides])
    return cfg, preflight(cfg)[1]


def test_mup_composes_with_a_device_count_rule_and_the_run_records_it():
    cfg, layout = _preflight("scaling=sqrt", "scaling.width_rule=mup", "model.base_width=16")
    effective = apply_scaling(cfg, layout)
    assert (effective.rule, effective.width_rule, effective.base_width) == ("sqrt", "mup", 16)
    assert cfg.scaling.effective.width_rule == "mup"
    assert reproduce_overrides(effective)[-1] == "scaling.width_rule=mup"  # a rerun stays μP
    rows = dict(scaling_rows(effective, cfg.scaling.reference))
    assert "from base width 16" in rows["width rule"] and rows["learning rate"].startswith("0.002121")


@pytest.mark.parametrize("overrides, message", [
    (["scaling=mup"], r"scaling.width_rule=mup needs model.base_width: the width the learning rate was tuned at"),
    (["scaling=mup", "model.base_width=0"], r"needs model.base_width.*not 0"),
    (["model.base_width=16"], r"model.base_width=16 asks for μP, but scaling.width_rule=standard: add scaling=mup"),
    (["scaling=mup", "model=vit", "data=digits"], r"needs model.base_width, and the model \(.*ViT\) takes none"),
    (["scaling=mup", "model=gpt_moe", "model.base_width=16"], r"model.base_width=16 \(μP\) covers the dense GPT blocks"),
    (["scaling=mup", "model.base_width=16", "model.optimizer._target_=lightning_parallel.optim.MuonWithAdamW"],
     r"Adam-family.*not lightning_parallel.optim.muon.MuonWithAdamW.*model.optimizer._target_=torch.optim.AdamW"),
    (["scaling.width_rule=cubic"], r"Unknown scaling.width_rule 'cubic': choose one of standard, mup"),
], ids=["no-base-width", "zero", "base-width-without-rule", "model-without-mup", "moe", "muon", "unknown-rule"])
def test_a_width_rule_that_cannot_apply_is_refused_before_start(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _preflight(*overrides)


def test_a_hugging_face_family_whose_shapes_mup_does_not_know_is_refused_before_start():
    pytest.importorskip("transformers")
    with pytest.raises(ConfigError, match=r"knows the shapes of llama, mistral, qwen2 decoders, not Gemma2Config.*"
                                          r"model.config=llama"):
        _preflight("scaling=mup", "model=hf_causal_lm", "data=text_padded", "model.base_width=16", "model.config=gemma2")
    _preflight("scaling=mup", "model=hf_causal_lm", "data=text_padded", "model.base_width=16")  # a Llama passes
