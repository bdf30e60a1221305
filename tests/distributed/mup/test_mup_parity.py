"""μP training under sharded layouts gives one process's parameters, and every rank's optimizer holds μP's groups.

The GPT recipe (width 32, 2 blocks, 4 heads) under μP from base width 8 (hidden matrices at lr / 4 with decay x 4,
init std / 2, logits / 4, attention 1/d_head), AdamW, fp32, padded byte windows, 8 steps. Built on meta and
materialised per rank under the suite's strategies, eagerly on one process: the same initial values. After the fit
each rank names the parameters of each optimizer group: the names (which FSDP2, tensor, pipeline and context splits
keep, and DeepSpeed's flat partitions list beside each group) land in the groups they land in on one process, at the
same learning rates. Context parallelism's ring attention keeps μP's 1/d_head scale.
"""

from functools import partial

import pytest

from lightning_parallel.strategies import HybridParallelStrategy as Hybrid
from lightning_parallel.strategies.deepspeed.strategy import DeepSpeedDataParallelStrategy as DeepSpeed
from lightning_parallel.testing import run_processes
from tests.distributed.parity_runs import SAMPLES, padded_text_dataset, tiny_gpt

pytestmark = pytest.mark.slow

STEPS, GLOBAL_BATCH, BASE_WIDTH = 8, 8, 8
# The tolerance the suite's AdamW parity holds under tensor 2 (issue 43's floor: the key biases' gradient is zero up to
# rounding and AdamW normalises that noise into lr-sized steps; tests/distributed/optim/test_muon_parity.py).
TOL = 1e-4
LAYOUTS = {  # (strategy, data-parallel size)
    "data 2 (ZeRO 3)": (partial(Hybrid, data_parallel_size=2, zero_stage=3), 2),
    "tensor 2": (partial(Hybrid, data_parallel_size=1, tensor_parallel_size=2), 1),
    "pipeline 2": (partial(Hybrid, data_parallel_size=1, pipeline_parallel_size=2), 1),
    "context 2 (ring)": (partial(Hybrid, data_parallel_size=1, context_parallel_size=2), 1),  # keeps 1/d_head
}
DEEPSPEED = {f"DeepSpeed ZeRO {stage}": (partial(DeepSpeed, zero_stage=stage), 2) for stage in (2, 3)}


def _groups(model):
    """``{name: (group kind, lr, weight decay)}`` of the parameters this rank's optimizer steps."""
    optimizer = model.trainer.optimizers[0]
    names = {id(p): n for n, p in model.named_parameters()}
    # DeepSpeed's ZeRO optimizer steps flat partitions: group i's model parameters are its bit16_groups[i] (ZeRO 1/2)
    # or fp16_groups[i] (ZeRO 3), beside param_groups[i] (the recipe's group, its keys kept).
    held = getattr(optimizer, "bit16_groups", None) or getattr(optimizer, "fp16_groups", None)
    params = held if held is not None else [g["params"] for g in optimizer.param_groups]
    assert len(params) == len(optimizer.param_groups)
    return {names[id(p)]: (g["mup"], g["lr"], g["weight_decay"]) for g, group in zip(optimizer.param_groups, params)
            for p in group}


def _fit(rank, world_size, cases):
    import torch

    from lightning_parallel.testing.compare import full_parameters
    from lightning_parallel.testing.fit import fit_recording_losses

    results = {}
    for name, (make_strategy, data_parallel, *base) in cases.items():
        base_width = base[0] if base else BASE_WIDTH
        model = tiny_gpt(base_width=base_width, optimizer=partial(torch.optim.AdamW, lr=1e-2))
        strategy = make_strategy() if world_size > 1 else "auto"
        losses = fit_recording_losses(model, strategy, world_size, padded_text_dataset(SAMPLES, 16),
                                      GLOBAL_BATCH // (data_parallel if world_size > 1 else 1), STEPS)
        groups = _groups(model) if base_width else {}
        results[name] = {"parameters": full_parameters(model), "groups": groups, "losses": losses}
    return results


@pytest.fixture(scope="module")
def references():
    return run_processes(_fit, 1, {"μP": LAYOUTS["tensor 2"], "standard": (*LAYOUTS["tensor 2"], None)},
                         timeout=600)[0]


def _check(per_rank, layouts, references):
    reference = references["μP"]
    # What the tolerance has to catch: μP's groups, init and multipliers move the parameters this far in 8 steps.
    effect = max(float((references["standard"]["parameters"][k] - v).abs().max())
                 for k, v in reference["parameters"].items())
    assert effect > 100 * TOL, effect
    hidden = {n for n, (kind, _, _) in reference["groups"].items() if kind == "hidden"}
    assert len(hidden) == 12 and {reference["groups"][n][1:] for n in hidden} == {(1e-2 / 4, 0.1 * 4)}
    worst = {}
    for layout in layouts:
        got = per_rank[0][layout]["parameters"]
        assert set(got) == set(reference["parameters"]), layout
        worst[layout] = max(float((got[k] - v).abs().max()) for k, v in reference["parameters"].items())
        held = {}
        for rank in per_rank:  # each rank's groups are the reference's, for the names it holds
            groups = rank[layout]["groups"]
            assert all(groups[n] == reference["groups"][n] for n in groups), layout
            held.update(groups)
        assert set(held) == set(reference["groups"]), layout  # together the ranks step every parameter
    print("μP, max |parameter - one process| after 8 steps:", worst, "| μP vs standard on one process:", effect)
    assert all(w < TOL for w in worst.values()), worst


def test_mup_under_zero3_tensor_pipeline_and_context_gives_one_process_parameters_and_groups_on_every_rank(
        references):
    _check(run_processes(_fit, 2, LAYOUTS, timeout=900), LAYOUTS, references)


@pytest.mark.extended  # DeepSpeed's start-up: the suite's time budget
def test_mup_under_deepspeed_zero2_and_zero3_gives_one_process_parameters_and_groups_on_every_rank(references):
    _check(run_processes(_fit, 2, DEEPSPEED, timeout=900), DEEPSPEED, references)


def _fit_llama(rank, world_size, options):
    import torch

    from examples.nlp.hf_causal_lm import HFCausalLM
    from lightning_parallel.testing.compare import full_parameters
    from lightning_parallel.testing.fit import fit_recording_losses
    from tests.distributed.adapters.test_hf_padded_loss import VOCAB, padded_samples

    torch.manual_seed(0)
    overrides = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16, "num_hidden_layers": 2}
    model = HFCausalLM(config="llama", config_overrides=overrides, vocab_size=VOCAB, base_width=16,
                       optimizer=partial(torch.optim.AdamW, lr=1e-2))  # built in configure_model: meta under Hybrid
    strategy = Hybrid(**options) if world_size > 1 else "auto"
    data_parallel = options.get("data_parallel_size", 1) if world_size > 1 else 1
    fit_recording_losses(model, strategy, world_size, padded_samples(), GLOBAL_BATCH // data_parallel, STEPS)
    return full_parameters(model), _groups(model)


@pytest.mark.extended  # the GPT recipe's layouts above run by default
def test_mup_on_a_hugging_face_llama_built_on_meta_under_zero3_gives_one_process_parameters():
    """Measured 1.9e-5 (layer 0's gate_proj: AdamW normalises near-zero gradient entries' rounding), the rest 3.4e-6;
    a hidden weight initialised without μP's std would be off by about 1e-2."""
    pytest.importorskip("transformers")
    options = dict(data_parallel_size=2, zero_stage=3)
    reference, reference_groups = run_processes(_fit_llama, 1, options, timeout=600)[0]
    per_rank = run_processes(_fit_llama, 2, options, timeout=900)
    worst = max(float((per_rank[0][0][k] - v).abs().max()) for k, v in reference.items())
    diffs = sorted((float((per_rank[0][0][k] - v).abs().max()), k) for k, v in reference.items())
    print("μP Llama (hidden 64 from base 16), ZeRO 3, max |parameter - one process|:", worst, diffs[-3:])
    assert worst < TOL
    assert sum(kind == "hidden" for kind, _, _ in reference_groups.values()) == 14
    assert all(rank[1] == reference_groups for rank in per_rank)
