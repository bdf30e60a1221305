"""Expert parallelism for Hugging Face mixture-of-experts decoders, from the model's own ``ep_plan``, with no glue.

transformers 5 keeps an MoE layer's experts in one module of grouped weights, ``gate_up_proj [E, 2I, H]`` (gate
rows, then up rows) and ``down_proj [E, H, I]``, which the layer's sparse block calls as ``experts(hidden_states
[n, H], top_k_index [n, k], top_k_weights [n, k]) -> [n, H]`` after its router; the config's
``base_model_ep_plan`` names these modules with the style ``"ep_dispatch_experts"``. :func:`apply_hf_experts`
replaces each such instance this rank holds by :class:`HFExpertParallel`: this rank's ``E/ep`` consecutive
experts, as ``Shard(0)`` DTensors of the full weights on the expert mesh under the unsplit names (checkpoints and
initialisation on ``meta`` see the unsplit model), taking the same arguments. Its forward sends each token copy
to the rank holding its expert (all-to-all, :func:`~lightning_parallel.parallel.experts.dispatch`), runs the
family's gated MLP ``down(act(gate(x)) * up(x))`` on the local experts (grouped GEMM) and sends the results back,
summed with the router's weights. The router, a shared expert and everything else stay as the other axes treat
them; the experts' gradients are reduced over the expert-data group by the strategy, as for the suite's own MoE.

Note:
    Why not transformers' own expert parallelism (``from_pretrained(distributed_config=...)``, the same style
    names): it builds its own mesh at load time and dispatches through hooks, while here the run's layout owns
    the mesh (experts borrow the data x context ranks), tensor, pipeline and FSDP2 compose around the experts, and
    a model built on ``meta`` is materialised by the suite. Replacing the module *instance* (never the class)
    keeps every other model of the process untouched.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Optional

from torch import Tensor, nn

from lightning_parallel.parallel.experts.dispatch import combine, dispatch
from lightning_parallel.parallel.experts.grouped import Kernel, grouped_mm
from lightning_parallel.parallel.experts.sharded import ExpertParallel, expert_range

DISPATCH_STYLE = "ep_dispatch_experts"
HF_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # experts along dim 0, in transformers' [out, in] layout

#: Families whose experts module was read and checked against the suite's computation (its transformers forward
#: is ``down(act(gate) * up)`` on concatenated ``gate_up_proj``, no bias, no post-expert norm, called with the
#: router's top-k indices and weights), and whose router balancing loss is transformers' ``load_balancing_loss_func``
#: from the ``gate``'s logits (:mod:`.hf_router_loss`, :mod:`.hf_router_pipeline`).
CHECKED_FAMILIES = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE", "olmoe": "OLMoE"}

#: Families whose experts the suite shards, each measured equal to one process under data 2 x expert 2 by the
#: coverage matrix (``python -m benchmarks.hf_coverage``, transformers 5.25, 2026-12-04: 8 padded SGD steps,
#: losses and every parameter within 1e-5; docs/hf-coverage.md). The structural checks of :func:`_refuse_layout`
#: alone are not enough: families whose experts call their activation differently (hy_v4, minimax_m3_vl_text:
#: no ``act_fn``; inkling2: a softcapped SwiGLU of two arguments) failed after start when let through. A family
#: joins after its matrix cell is PARITY.
EXPERT_FAMILIES = frozenset({
    *CHECKED_FAMILIES, "afmoe", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_v2", "deepseek_v3",
    "deepseek_v32", "deepseek_v4", "dots1", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint", "glm4_moe",
    "glm4_moe_lite", "glm_moe_dsa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",
    "hunyuan_v1_moe", "hy_v3", "inkling_text", "jamba", "kimi_linear", "kolibri1", "laguna", "lara_mini", "lfm2_moe",
    "mellum", "mimo_v2_flash", "minicpm5_moe", "minimax", "minimax_m2", "param2moe", "phimoe", "qwen3_5_moe_text",
    "qwen3_next", "sarvam_mla", "sarvam_moe", "solar_open",
})

#: ``(attribute of transformers' experts module, the value the suite computes with, what other values mean)``.
_LAYOUT = (
    ("has_gate", True, "experts without a gate projection"),
    ("is_concatenated", True, "an interleaved gate/up layout"),
    ("is_transposed", False, "transposed expert weights"),
    ("has_bias", False, "expert biases"),
    ("has_post_expert_norm", False, "a norm after each expert"),
)


def hf_expert_plan(model: nn.Module) -> dict[str, str]:
    """``{glob: style}`` of the model's expert-parallel plan, keys relative to ``model``: its ``ep_plan`` (the
    class's plan plus ``config.base_model_ep_plan`` under the base model's prefix), else the config's, re-rooted.

    Args:
        model: the ``transformers`` model.
    """
    plan = getattr(model, "ep_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    base_plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    root = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    return {f"{root}{key}": value for key, value in base_plan.items()}


def hf_experts_modules(model: nn.Module, prefix: str = "") -> list[str]:
    """Names (under ``prefix``) of the modules ``model``'s plan gives the style ``"ep_dispatch_experts"``.

    Args:
        model: the ``transformers`` model, or a module holding it at ``prefix``.
        prefix: the model's attribute path in ``model`` when ``model`` is the holder (``""``: it is the model).
    """
    inner = model.get_submodule(prefix) if prefix else model
    globs = [key for key, style in hf_expert_plan(inner).items() if style == DISPATCH_STYLE]
    root = f"{prefix}." if prefix else ""
    names = [name for name, _ in model.named_modules() if name]
    return [name for name in names if any(fnmatch.fnmatchcase(name, root + glob) for glob in globs)]


def _family(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", "") or type(model).__name__)


def _refuse_layout(model: nn.Module, name: str, experts: nn.Module) -> None:
    """Refuse an experts module the suite does not compute exactly as transformers does (named, with the cause)."""
    owner = type(model).__name__
    missing = [w for w in HF_EXPERT_WEIGHTS if getattr(getattr(experts, w, None), "dim", lambda: 0)() != 3]
    if missing or not int(getattr(experts, "num_experts", 0) or 0):
        raise ValueError(
            f"{owner}.{name} ({type(experts).__name__}) holds no grouped {'/'.join(missing) or 'num_experts'}: "
            "the suite shards transformers' grouped experts ([num_experts, ...] weights). Set expert_parallel_size=1."
        )
    for attribute, expected, meaning in _LAYOUT:
        if bool(getattr(experts, attribute, expected)) != expected:
            raise ValueError(
                f"{owner}.{name} ({type(experts).__name__}) has {meaning} ({attribute}="
                f"{getattr(experts, attribute)}), which the suite's expert-parallel MLP does not compute: "
                "set expert_parallel_size=1."
            )
    if _family(model) not in EXPERT_FAMILIES:
        raise ValueError(
            f"expert parallelism on {owner} ({_family(model)}): the suite shards the experts of the "
            f"{len(EXPERT_FAMILIES)} families measured equal to one process (EXPERT_FAMILIES in "
            f"lightning_parallel/adapters/hf/experts.py; docs/hf-coverage.md); {_family(model)}'s experts module "
            f"{type(experts).__name__} is not among them (its activation may be called differently). Use one of "
            "those families, or set expert_parallel_size=1."
        )


def check_hf_experts(model: nn.Module, size: int) -> list[str]:
    """Refuse, before any process starts, a model whose experts the suite cannot shard ``size`` ways.

    Args:
        model: the ``transformers`` model (on ``meta`` or with storage).
        size: the expert-parallel size.

    Returns:
        The names of its experts modules (relative to ``model``).

    Raises:
        ValueError: a model without an expert-parallel plan (naming the families that have one), a plan that names
            no module, an experts module the suite does not compute (its family or layout), or an expert count
            ``size`` does not divide (with the sizes that do).
    """
    owner, checked = type(model).__name__, f"{len(EXPERT_FAMILIES)} families (EXPERT_FAMILIES, docs/hf-coverage.md)"
    if DISPATCH_STYLE not in hf_expert_plan(model).values():
        raise ValueError(
            f"expert_parallel_size={size}, but {owner} ({_family(model)}) has no expert-parallel plan "
            f"(config.base_model_ep_plan naming an '{DISPATCH_STYLE}' module): it is not a mixture-of-experts model "
            f"the suite can shard. Families with one whose experts the suite shards: {checked}. Use one of those, or "
            "set expert_parallel_size=1."
        )
    names = hf_experts_modules(model)
    if not names:
        raise ValueError(
            f"{owner}'s ep_plan names experts modules ({', '.join(hf_expert_plan(model))}) that match no submodule "
            "(mlp_only_layers or decoder_sparse_step leaving no MoE layer?): set expert_parallel_size=1."
        )
    for name in names:
        experts = model.get_submodule(name)
        _refuse_layout(model, name, experts)
        count = int(experts.num_experts)
        if count % size:
            divisors = [d for d in range(1, count + 1) if count % d == 0]
            raise ValueError(
                f"{owner}.{name} holds {count} experts, which expert_parallel_size={size} does not divide: use a "
                f"size among {divisors}."
            )
    return names


class HFExpertParallel(ExpertParallel):
    """Stands in for a transformers experts module, holding only this rank's ``E/ep`` experts.

    Called as the module it replaces: ``forward(hidden_states [n, H], top_k_index [n, k], top_k_weights [n, k])
    -> [n, H]``, dropless (every copy runs, as in transformers). A subclass of
    :class:`~lightning_parallel.parallel.experts.sharded.ExpertParallel`, so the engine's
    :func:`~lightning_parallel.parallel.experts.sharded.expert_parameters` leaves its weights out of FSDP2 and
    reduces their gradients over the expert-data group.

    Args:
        experts: transformers' experts module (on ``meta`` or with storage; dropped after the slices are taken:
            the initial values of a ``meta`` model come from the suite's initialisation plan, by name).
        mesh: the expert group as a 1-D ``DeviceMesh``: the slices become ``Shard(0)`` DTensors of the full weights.
        kernel: torch's grouped GEMM (through ``_compat``); None runs the loop.
    """

    def __init__(self, experts: nn.Module, mesh: Any, kernel: Optional[Kernel] = None) -> None:
        nn.Module.__init__(self)  # not ExpertParallel's: the weights and the MLP are transformers'
        from torch.distributed.tensor import DTensor, Shard

        group = mesh.get_group()
        self.num_experts = int(experts.num_experts)
        self.first, self.end = expert_range(self.num_experts, group)
        self.group, self.capacity_group, self.kernel = group, group, kernel
        for name in HF_EXPERT_WEIGHTS:
            full = getattr(experts, name)
            local = full.detach()[self.first:self.end]
            local = local if local.is_meta else local.clone()
            local = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape,
                                       stride=full.stride())
            self.register_parameter(name, nn.Parameter(local, requires_grad=full.requires_grad))
        self.act_fn = experts.act_fn

    def reset_parameters(self) -> None:
        """Refused: transformers initialises experts through the model (``_init_weights``), which the suite's
        materialisation calls on the unsplit module by name."""
        raise ValueError(
            "HFExpertParallel is initialised through the Hugging Face model's own initialiser: build the model on "
            "meta under the strategy (configure_model) or with its weights before parallelising."
        )

    def expert_mlp(self, rows: Tensor, counts: Tensor) -> Tensor:
        """``down(act(gate(x)) * up(x))`` of rows sorted by local expert (``counts`` rows each).

        Args:
            rows: ``[m, H]`` token copies sorted by local expert.
            counts: ``[E/ep]`` rows per local expert.
        """
        kernel = self.kernel if rows.shape[0] else None  # the kernel's backward fails on no rows; the loop does not
        gate_up = _local(self.gate_up_proj).transpose(1, 2)  # [E/ep, H, 2I]: grouped_mm's [in, out]
        gate, up = grouped_mm(rows, gate_up, counts, kernel).chunk(2, dim=-1)
        down = _local(self.down_proj).transpose(1, 2)
        return grouped_mm((self.act_fn(gate) * up).contiguous(), down, counts, kernel)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        rows, counts, route = dispatch(hidden_states, top_k_index, self.num_experts, self.group)
        self.record_load(counts)
        rows = rows.to(self.down_proj.dtype)
        out = self.expert_mlp(rows, counts).to(rows.dtype)  # one dtype on every rank for the all-to-all back
        return combine(out, route, top_k_weights, self.group).to(hidden_states.dtype)


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local part (differentiable), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def apply_hf_experts(module: nn.Module, prefix: str, mesh: Any, kernel: Optional[Kernel] = None) -> list[str]:
    """Replace each experts module of the plan that this rank holds by its :class:`HFExpertParallel` share.

    Args:
        module: the LightningModule after its pipeline split (a stage may hold no MoE layer).
        prefix: the Hugging Face model's attribute path in ``module`` (``""``: ``module`` is the model).
        mesh: the 1-D expert mesh.
        kernel: torch's grouped GEMM (``lightning_parallel._compat.grouped_mm``), or None for the loop.

    Returns:
        The names of the replaced modules (relative to ``module``).
    """
    replaced = []
    for name in hf_experts_modules(module, prefix):
        experts = module.get_submodule(name)
        if isinstance(experts, ExpertParallel) or not all(hasattr(experts, w) for w in HF_EXPERT_WEIGHTS):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, HFExpertParallel(experts, mesh, kernel))
        replaced.append(name)
    return replaced


def expert_shards(module: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """``{name: (local shape, full shape)}`` of every :class:`HFExpertParallel` weight (tests and start-up tables).

    Args:
        module: the parallelised model.
    """
    return {f"{prefix}.{name}": (tuple(_local(p).shape), tuple(p.shape))
            for prefix, m in module.named_modules() if isinstance(m, HFExpertParallel)
            for name, p in m.named_parameters(recurse=False)}
