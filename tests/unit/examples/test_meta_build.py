"""The recipes build their layers in ``configure_model``: on ``meta`` under the suite's strategies, eagerly elsewhere,
with the same initial values either way; the Hugging Face recipe starts from a ``save_pretrained`` folder."""

from functools import partial

import pytest
import torch

from examples.nlp.model import GPT
from examples.recsys.model import DLRM
from examples.vision.model import ViT
from lightning_parallel.adapters import adapt
from lightning_parallel.parallel.materialize import materialize, plan_initialisation

transformers = pytest.importorskip("transformers", reason="pip install -e '.[hf]'")

from examples.nlp.hf_causal_lm import HFCausalLM, PretrainedWeights, build_config  # noqa: E402

RECIPES = {
    "gpt": partial(GPT, vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4),
    "vit": partial(ViT, d_model=16, n_layer=2, n_head=2),
    "dlrm": partial(DLRM, num_dense=3, table_sizes=(64, 32, 8), embedding_dim=8),
    "llama": partial(HFCausalLM, "llama"),
    "qwen2": partial(HFCausalLM, "qwen2"),  # tied embedding and LM head
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_layers_are_created_once_in_configure_model(name):
    module = RECIPES[name]()
    assert not list(module.parameters())  # __init__ creates nothing
    assert module.build() is module
    first = [id(p) for p in module.parameters()]
    module.configure_model()  # fit then test with one Trainer: built once
    assert first and [id(p) for p in module.parameters()] == first


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_an_eager_build_has_the_values_every_layout_materialises(name):
    torch.manual_seed(7)
    eager = RECIPES[name]().build()
    with torch.device("meta"):
        deferred = RECIPES[name]().build()
    assert all(t.is_meta for t in [*deferred.parameters(), *deferred.buffers()])
    init = adapt(deferred).init_module
    materialize(deferred, torch.device("cpu"), plan_initialisation(deferred, 7, init), init)  # no split: all of it
    expected, got = eager.state_dict(), deferred.state_dict()
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
    torch.manual_seed(8)
    assert not torch.equal(next(RECIPES[name]().build().parameters()), next(eager.parameters()))  # seeded by the run


@torch.no_grad()
def test_the_recipes_initialisation_schemes_survive_the_move_to_reset_parameters():
    torch.manual_seed(0)
    gpt = RECIPES["gpt"]().build()
    assert abs(float(gpt.blocks["0"].mlp.up.weight.std()) - 0.02) < 0.003 and not gpt.blocks["0"].mlp.up.bias.any()
    assert abs(float(gpt.embed.tok.weight.std()) - 0.02) < 0.003
    vit = RECIPES["vit"]().build()
    assert abs(float(vit.patch_embed.pos.std()) - 0.02) < 0.005 and not vit.head.proj.bias.any()
    dlrm = RECIPES["dlrm"]().build()
    assert abs(float(dlrm.embeddings["0"].weight.std()) - 8**-0.5) < 0.03  # unit-norm rows on average


def test_a_zero3_partitioned_parameter_decays_by_its_full_shape():
    from examples.optimization import weight_decay_groups

    matrix, vector = torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.empty(0))
    matrix.ds_shape, vector.ds_shape = torch.Size([4, 4]), torch.Size([4])  # what deepspeed.zero.Init leaves
    module = torch.nn.Module()
    module.matrix, module.vector = matrix, vector
    decay, no_decay = weight_decay_groups(module, 0.1)
    assert decay["params"] == [matrix] and no_decay["params"] == [vector]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(build_config("qwen2", vocab_size=160))
    model.save_pretrained(folder)
    return folder, model


def test_pretrained_takes_the_folders_config_and_vocabulary_and_loads_its_weights(pretrained):
    folder, saved = pretrained
    module = HFCausalLM(config="mistral", vocab_size=128, pretrained=str(folder))  # the recipe's defaults
    assert module.model_config.vocab_size == 160 and module.model_config.model_type == "qwen2"
    (callback,) = module.configure_callbacks()
    assert isinstance(callback, PretrainedWeights) and callback.folder == folder
    module.build()  # with storage: loaded here, so the callback skips it
    assert module.pretrained_loaded
    expected = saved.state_dict()
    for key, value in module.model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
    assert HFCausalLM().configure_callbacks() == []


def test_pretrained_on_meta_is_left_to_the_callback(pretrained):
    folder, _ = pretrained
    with torch.device("meta"):
        module = HFCausalLM(pretrained=str(folder)).build()
    assert not module.pretrained_loaded and all(p.is_meta for p in module.parameters())


def test_a_pretrained_folder_that_cannot_serve_says_what_to_change(pretrained, tmp_path):
    folder, _ = pretrained
    with pytest.raises(ValueError, match="set model.vocab_size=160 or less"):
        HFCausalLM(pretrained=str(folder), vocab_size=256)
    with pytest.raises(ValueError, match="holds no config.json"):
        HFCausalLM(pretrained=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no causal LM in transformers: pick a decoder-only family"):
        HFCausalLM("vit")  # refused in __init__, before configure_model could run inside deepspeed.zero.Init
