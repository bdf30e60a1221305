"""The mixture-of-experts block of the GPT recipe on one process: against a dense reference, and its hooks."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from examples.nlp.model import GPT
from examples.nlp.moe import (
    GroupedExperts,
    MoEFeedForward,
    RoutingStats,
    balancing_loss,
    loop_grouped_mm,
    model_balancing_loss,
    moe_settings,
)

D, H, E, K = 16, 32, 8, 2


def _block(**kwargs) -> MoEFeedForward:
    torch.manual_seed(0)
    block = MoEFeedForward(D, H, E, **{"top_k": K, **kwargs})
    with torch.no_grad():
        block.router.weight.mul_(4.0)  # peaked routing
    return block


def _dense_reference(block: MoEFeedForward, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every expert on every token, the chosen ones summed with their weights; capacity by a plain token loop."""
    flat = x.reshape(-1, D)
    ids, weights, _ = block.route(flat)
    hidden = F.gelu(torch.einsum("td,edh->teh", flat, block.experts.w_up))
    every = torch.einsum("teh,ehd->ted", hidden, block.experts.w_down)
    chosen = every.gather(1, ids[..., None].expand(-1, -1, D))
    keep = torch.ones_like(weights)
    if block.capacity_factor is not None:
        cap, taken = block.capacity(flat.shape[0]), [0] * E
        for t in range(flat.shape[0]):  # token order: the lowest indices are kept
            for j in range(K):
                e = int(ids[t, j])
                taken[e] += 1
                keep[t, j] = float(taken[e] <= cap)
    out = (chosen * (weights * keep)[..., None]).sum(1)
    return out.reshape(x.shape), int((keep == 0).sum())


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_block_matches_the_dense_reference_in_value_and_gradients(router, capacity_factor):
    block = _block(router=router, capacity_factor=capacity_factor)
    if router == "sigmoid":
        block.expert_bias.copy_(0.05 * torch.randn(E))
    reference = copy.deepcopy(block)
    x = torch.randn(4, 8, D, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    r = torch.randn(4, 8, D)
    out = block(x)
    out_ref, dropped = _dense_reference(reference, x_ref)
    (out * r).sum().backward()
    (out_ref * r).sum().backward()
    assert (out - out_ref).abs().max() < 1e-5
    assert int(block.dropped_tokens) == dropped and (dropped > 0) == (capacity_factor is not None)
    pairs = [(x, x_ref), (block.router.weight, reference.router.weight),
             (block.experts.w_up, reference.experts.w_up), (block.experts.w_down, reference.experts.w_down)]
    for mine, theirs in pairs:
        assert (mine.grad - theirs.grad).abs().max() < 1e-5


def test_capacity_drops_the_highest_token_indices_the_same_way_every_time():
    block = _block(capacity_factor=0.5)
    x = torch.randn(32, D)
    first, dropped = block(x), int(block.dropped_tokens)
    assert torch.equal(block(x), first) and int(block.dropped_tokens) == dropped > 0
    # The last token's copies are the first to go: a copy of token 0 is never dropped at this capacity.
    assert block.capacity(32) >= K
    assert (first[0] - _dense_reference(block, x[:1])[0][0]).abs().max() < 1e-6


def test_balancing_loss_is_switch_formula_and_one_for_uniform_routing():
    uniform = RoutingStats(torch.full((E,), 4.0), torch.full((E,), 2.0), torch.tensor(16.0), torch.tensor(0.0))
    assert balancing_loss([uniform], top_k=2).item() == pytest.approx(1.0)
    counts, probs = torch.rand(E) * 10, torch.rand(E) * 3
    tokens = probs.sum()
    stats = RoutingStats(counts, probs, tokens, torch.tensor(0.0))
    expected = E * ((counts / (K * tokens)) * (probs / tokens)).sum()
    assert balancing_loss([stats], top_k=K).item() == pytest.approx(expected.item(), rel=1e-6)


def test_balancing_loss_of_micro_batches_equals_the_whole_batch_in_value_and_gradient():
    block = _block(aux_loss_weight=1.0)
    whole = copy.deepcopy(block)
    x = torch.randn(4, 8, D)
    for piece in x.chunk(2):
        block(piece)
    whole(x)
    loss = balancing_loss(block.pop_routing_stats(), K)
    loss_whole = balancing_loss(whole.pop_routing_stats(), K)
    loss.backward()
    loss_whole.backward()
    assert (loss - loss_whole).abs() < 1e-6
    assert (block.router.weight.grad - whole.router.weight.grad).abs().max() < 1e-6


def test_model_balancing_loss_weighs_each_layer_and_takes_the_stats():
    block = _block(aux_loss_weight=0.25, capacity_factor=0.5)
    block(torch.randn(16, D))
    expected = 0.25 * balancing_loss(list(block.routing_stats), K)
    loss, dropped = model_balancing_loss(block)
    assert loss.item() == pytest.approx(expected.item()) and dropped == block.dropped_tokens
    assert block.routing_stats == []


def test_stats_are_recorded_in_training_only():
    block = _block().eval()
    block(torch.randn(8, D))
    assert block.routing_stats == [] and block.routed_counts.sum() == 0
    block.train()(torch.randn(8, D))
    assert len(block.routing_stats) == 1 and block.routed_counts.sum() == 8 * K


def test_sigmoid_bias_chooses_without_weighing_and_its_update_balances():
    block = _block(router="sigmoid", top_k=1, bias_update_rate=0.5)
    block.expert_bias[3] = 10.0  # every token picks expert 3
    flat = torch.randn(16, D)
    ids, weights, _ = block.route(flat)
    assert (ids == 3).all() and torch.allclose(weights, torch.ones_like(weights))  # k=1: renormalised to 1
    block.normalize_weights = False
    _, raw, _ = block.route(flat)
    assert torch.allclose(raw[:, 0], torch.sigmoid(block.router(flat))[:, 3])  # the score, not score + bias
    block(flat)
    before = block.expert_bias.clone()
    block.update_expert_bias()
    delta = block.expert_bias - before
    assert delta[3] < 0 and (delta[torch.arange(E) != 3] > 0).all() and abs(float(delta.sum())) < 1e-6
    assert block.routed_counts.sum() == 0


def test_grouped_experts_loop_equals_a_matmul_per_row():
    experts = GroupedExperts(E, D, H)
    counts = torch.tensor([3, 0, 5, 1, 0, 2, 4, 1])
    x = torch.randn(int(counts.sum()), D)
    expert_of = torch.repeat_interleave(torch.arange(E), counts)
    rows = torch.stack([x[i] @ experts.w_up[e] for i, e in enumerate(expert_of)])
    assert (loop_grouped_mm(x, experts.w_up, counts) - rows).abs().max() < 1e-6
    assert loop_grouped_mm(x[:0], experts.w_up[:0], counts[:0]).shape == (0, H)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [(dict(top_k=9), "top_k=9"), (dict(router="relu"), "router='relu'"), (dict(capacity_factor=0.0), "dropless")],
)
def test_bad_settings_are_refused_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEFeedForward(D, H, E, **{"top_k": 2, **kwargs})


def test_misuse_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="model.train"):
        balancing_loss([], K)
    with pytest.raises(ValueError, match="router='sigmoid'"):
        _block().update_expert_bias()
    with pytest.raises(ValueError, match="unknown keys"):
        moe_settings({"num_experts": 4, "experts": 2}, 4)
    with pytest.raises(ValueError, match="every=0"):
        moe_settings({"num_experts": 4, "every": 0}, 4)


def test_moe_settings_pick_every_kth_block():
    assert moe_settings({"num_experts": 4, "every": 2}, 4)[0] == {1, 3}
    assert moe_settings({"num_experts": 4}, 3)[0] == {0, 1, 2}


GPT_SIZE = dict(vocab_size=32, seq_len=8, d_model=16, n_layer=2, n_head=2, mlp_ratio=2)


def test_gpt_without_moe_is_unchanged_and_with_moe_keeps_the_dense_blocks_values():
    torch.manual_seed(0)
    dense = GPT(**GPT_SIZE).build()
    torch.manual_seed(0)
    moe = GPT(**GPT_SIZE, moe={"num_experts": 4, "top_k": 2, "every": 2}).build()
    names = dict(dense.named_parameters())
    assert "blocks.1.mlp.up.weight" in names and not any("experts" in n or "router" in n for n in names)
    moe_names = dict(moe.named_parameters())
    assert {"blocks.1.mlp.router.weight", "blocks.1.mlp.experts.w_up", "blocks.1.mlp.experts.w_down"} <= set(moe_names)
    assert moe_names["blocks.1.mlp.experts.w_up"].shape == (4, 16, 32)
    for name, param in names.items():  # seeded by module name: the dense blocks start equal
        if not name.startswith("blocks.1.mlp"):
            assert torch.equal(param, moe_names[name]), name
    assert math.isclose(float(moe_names["blocks.1.mlp.experts.w_up"].detach().std()), 0.02, rel_tol=0.2)


def test_gpt_moe_training_step_adds_the_balancing_loss():
    import lightning.pytorch as pl

    torch.manual_seed(0)
    model = GPT(**GPT_SIZE, moe={"num_experts": 4, "aux_loss_weight": 0.5, "router": "sigmoid"})
    data = torch.randint(0, 32, (8, 9))
    loader = torch.utils.data.DataLoader(list(zip(data[:, :-1], data[:, 1:])), batch_size=4)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    metrics = trainer.callback_metrics
    assert 0.5 * 0.9 < float(metrics["moe_aux_loss"]) < 0.5 * 4  # about the weight for near-uniform routing
    assert float(metrics["moe_dropped"]) == 0.0
    assert model.blocks["0"].mlp.expert_bias.abs().sum() > 0  # updated after the steps


def test_gpt_moe_built_on_meta_materialises_the_eager_values():
    from lightning_parallel.adapters import adapt
    from lightning_parallel.parallel.materialize import materialize, plan_initialisation

    settings = {"num_experts": 4, "router": "sigmoid", "every": 2}
    torch.manual_seed(7)
    eager = GPT(**GPT_SIZE, moe=settings).build()
    with torch.device("meta"):
        deferred = GPT(**GPT_SIZE, moe=settings).build()
    init = adapt(deferred).init_module
    materialize(deferred, torch.device("cpu"), plan_initialisation(deferred, 7, init), init)
    expected, got = eager.state_dict(), deferred.state_dict()
    assert expected.keys() == got.keys() and "blocks.1.mlp.expert_bias" in got
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    assert not deferred.blocks["1"].mlp.routed_counts.is_meta


def test_gpt_moe_balancing_loss_is_refused_under_a_schedule_that_runs_a_backward_before_the_last_forward():
    model = GPT(**GPT_SIZE, moe={"num_experts": 4, "aux_loss_weight": 0.5})
    with pytest.raises(ValueError, match="schedule='gpipe'"):
        model.check_batch_split(["data_parallel_size=2", "pipeline_parallel_size=2 (schedule='1f1b')"])
    model.check_batch_split(["pipeline_parallel_size=2 (schedule='gpipe')"])  # exact there
    model.check_batch_split(["data_parallel_size=2", "context_parallel_size=2"])
    GPT(**GPT_SIZE, moe={"num_experts": 4, "router": "sigmoid"}).check_batch_split(
        ["pipeline_parallel_size=2 (schedule='1f1b')"])  # the bias update needs no schedule


def test_moe_block_trains_under_bf16_autocast_in_the_input_dtype():
    """bf16-mixed: the experts' matmuls give bf16 rows while the normed input stays fp32 (index_add refused the mix)."""
    block = MoEFeedForward(16, 32, 4)
    x = torch.randn(2, 5, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(torch.nn.functional.layer_norm(x, (16,)))
    y.sum().backward()
    assert y.dtype == torch.float32 and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    reference = block(torch.nn.functional.layer_norm(x.detach(), (16,)))
    assert (y.detach() - reference.detach()).abs().max() < 5e-2
