"""μP on Hugging Face decoders whose shapes the adapter knows (lightning_parallel/adapters/hf/mup.py, through the
HF recipe's model.base_width): roles by name, learning-rate groups, initial scales, attention scale, logits."""

import math
from functools import partial

import pytest
import torch

pytest.importorskip("transformers")

from examples.nlp.hf_causal_lm import HFCausalLM  # noqa: E402

LR, WD = 2e-3, 0.1
WIDE = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}  # 4x TINY_SHAPE's width, 4 heads kept


def _llama(base_width, family="llama", overrides=WIDE):
    torch.manual_seed(0)
    return HFCausalLM(config=family, config_overrides=overrides, base_width=base_width, weight_decay=WD,
                      optimizer=partial(torch.optim.AdamW, lr=LR)).build()


def _groups_by_name(module):
    optimizer = module.configure_optimizers()["optimizer"]
    names = {id(p): n for n, p in module.named_parameters()}
    return {names[id(p)]: (g.get("mup"), g["lr"], g["weight_decay"]) for g in optimizer.param_groups
            for p in g["params"]}


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biases on q/k/v, the head tied to the embedding
def test_the_projections_train_at_lr_times_base_over_width_embeddings_head_norms_biases_at_the_base_lr(family):
    groups = _groups_by_name(_llama(32, family))
    hidden = {n for n, (kind, _, _) in groups.items() if kind == "hidden"}
    assert hidden == {f"model.model.layers.{i}.{m}.weight" for i in range(4) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    for name, (kind, lr, decay) in groups.items():
        expected = (LR / 4, WD * 4) if name in hidden else (LR, WD if name == "model.lm_head.weight" else 0.0)
        assert (lr, decay) == pytest.approx(expected), name
    assert ("model.lm_head.weight" in groups) == (family == "llama")


def test_initial_scales_attention_scale_and_logits_multiplier_are_mups():
    module = _llama(32)
    model = module.model
    hidden = torch.cat([p.detach().flatten() for n, p in model.named_parameters() if n.endswith("_proj.weight")])
    assert float(hidden.std()) == pytest.approx(0.02 / 2, rel=0.03)  # initializer_range x sqrt(32 / 128)
    for table in (model.model.embed_tokens.weight, model.lm_head.weight):
        assert float(table.detach().std()) == pytest.approx(0.02, rel=0.05)
    assert [layer.self_attn.scaling for layer in model.model.layers] == [pytest.approx(math.sqrt(32 / 4) / 32)] * 4
    assert model.config.mup_base_width == 32
    ids = torch.randint(1, 128, (2, 8))
    out = model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(out.logits, out.hidden_states[-1] @ model.lm_head.weight.T / 4)


def test_at_the_base_width_mup_is_the_standard_parametrisation_exactly():
    mup, standard = _llama(128), _llama(None)
    ids = torch.randint(1, 128, (2, 8))
    assert torch.equal(mup(ids), standard(ids))
    lr_and_decay = [{n: v[1:] for n, v in _groups_by_name(m).items()} for m in (mup, standard)]
    assert lr_and_decay[0] == lr_and_decay[1]


def test_a_family_or_folder_mup_does_not_know_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"base_width=32 \(μP\) knows the shapes of llama, mistral, qwen2.*Gemma2"):
        HFCausalLM(config="gemma2", base_width=32)
    folder = tmp_path / "sp"
    _llama(None, overrides={}).model.save_pretrained(folder)
    with pytest.raises(ValueError, match=r"with model.pretrained: the folder's weights were trained without μP"):
        HFCausalLM(pretrained=str(folder), base_width=16)
    _llama(16, overrides={}).model.save_pretrained(tmp_path / "mup")  # records mup_base_width=16 in config.json
    with pytest.raises(ValueError, match=r"records μP's mup_base_width=16: set model.base_width=16"):
        HFCausalLM(pretrained=str(tmp_path / "mup"))
    assert HFCausalLM(pretrained=str(tmp_path / "mup"), base_width=16).hparams.base_width == 16
