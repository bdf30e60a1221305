"""The GPT recipe under μP (model.base_width): the learning-rate groups, initial scales, attention scale and logits
multiplier μP prescribes (examples/nlp/model.py, examples/nlp/gpt_parts.py, lightning_parallel/mup/)."""

import math
from functools import partial

import pytest
import torch

from examples.nlp.model import GPT, STD

LR, WD = 2e-3, 0.1


def _gpt(width, base_width, seq_len=8):
    torch.manual_seed(0)
    return GPT(seq_len=seq_len, d_model=width, n_layer=2, n_head=4, weight_decay=WD, base_width=base_width,
               optimizer=partial(torch.optim.AdamW, lr=LR)).build()


def _groups_by_name(model):
    optimizer = model.configure_optimizers()["optimizer"]
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: (g.get("mup"), g["lr"], g["weight_decay"]) for g in optimizer.param_groups
            for p in g["params"]}


def test_hidden_matrices_train_at_lr_times_base_over_width_and_everything_else_at_the_base_lr():
    groups = _groups_by_name(_gpt(128, 32))  # width 4x the base
    hidden = {n for n, (kind, _, _) in groups.items() if kind == "hidden"}
    assert hidden == {f"blocks.{i}.{m}.weight" for i in range(2)
                      for m in ("attn.q", "attn.k", "attn.v", "attn.out", "mlp.up", "mlp.down")}
    for name, (kind, lr, decay) in groups.items():
        if name in hidden:
            assert (lr, decay) == (pytest.approx(LR / 4), pytest.approx(WD * 4)), name  # lr x decay as at base
        else:  # embeddings, head, norms, biases
            assert lr == LR and decay == (WD if name == "head.proj.weight" else 0.0), name


def test_initial_scales_attention_scale_and_logits_multiplier_are_mups():
    model = _gpt(256, 32)  # m = 8, d_head = 64
    hidden = torch.cat([p.detach().flatten() for n, p in model.named_parameters()
                        if n.startswith("blocks.") and p.dim() == 2])
    assert float(hidden.std()) == pytest.approx(STD / math.sqrt(8), rel=0.02)
    for table in (model.embed.tok.weight, model.embed.pos.weight, model.head.proj.weight):  # base init kept
        assert float(table.detach().std()) == pytest.approx(STD, rel=0.05)
    assert model.blocks["0"].attn.core.scale == pytest.approx(math.sqrt(64 / 8) / 64)  # sqrt(base d_head) / d_head
    assert model.head.output_multiplier == 1 / 8
    idx = torch.randint(0, 256, (2, 8))
    hidden_states = model.blocks["1"](model.blocks["0"](model.embed(idx)))
    torch.testing.assert_close(model(idx), model.head.proj(model.head.norm(hidden_states)) / 8)


def test_at_the_base_width_mup_is_the_standard_parametrisation_exactly():
    mup, standard = _gpt(64, 64), _gpt(64, None)
    idx = torch.randint(0, 256, (2, 8))
    assert torch.equal(mup(idx), standard(idx))
    lr_and_decay = [{n: v[1:] for n, v in _groups_by_name(model).items()} for model in (mup, standard)]
    assert lr_and_decay[0] == lr_and_decay[1]
