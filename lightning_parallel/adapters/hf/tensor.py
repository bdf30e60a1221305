"""A Hugging Face model's own tensor-parallel plan, in the suite's style names, rooted where the model sits.

``transformers`` ships a plan with every decoder: ``model.tp_plan`` (the class's ``_tp_plan``,
e.g. ``{"lm_head": "colwise_gather_output"}``, plus ``config.base_model_tp_plan`` under the
base model's prefix). Its keys are relative to the HF model and its values are
transformers' style names; :func:`hf_tensor_plan` re-roots the keys under the attribute
path where the model sits in a LightningModule and maps each style to the suite's style of
the same numerics (:data:`HF_STYLES`), or to a :class:`RefusedStyle` that says why it cannot
be run (:data:`REFUSED_STYLES`) -- raised only if the user's ``plan=`` does not replace it.
:func:`hf_head_dimensions` gives the head counts from the config that the plan splits.

Sequence parallelism (:func:`sequence_parallel_entries`) is built for decoders laid out as
``embed_tokens`` / ``layers`` / ``norm``: the embedding output stays replicated, so the
model computes its causal mask and rotary positions from the *global* sequence; the first
decoder layer slices the stream; each layer's norms run on the slice; attention and MLP
gather the sequence on entry (by keyword or position) and reduce-scatter on exit; the final
norm hands the slice to the LM head, which gathers it. Any module with parameters that
would see only the slice without being planned is refused, naming its class.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from lightning_parallel import _compat
from lightning_parallel.parallel.tensor.aliases import HF_STYLES, RefusedStyle, suite_style  # noqa: F401 (HF_STYLES, suite_style re-exported)
from lightning_parallel.parallel.tensor.styles import is_norm

_MOE = "mixture-of-experts layers need expert routing and a partial-output reduction the suite does not implement"
_LOCAL = ("transformers' local-tensor styles leave partial sums for a parent's 'gather' entry to reduce, outside "
          "DTensor; the suite runs the DTensor styles 'colwise'/'rowwise' instead")
REFUSED_STYLES: dict[str, str] = {
    "packed_colwise": "fused projections (gate_up_proj) need a strided shard that no public torch ParallelStyle gives",
    "packed_rowwise": "fused projections need a strided shard that no public torch ParallelStyle gives",
    "moe_tp_experts": _MOE, "moe_identity_expert": _MOE, "all_reduce": _MOE, "ep_dispatch_experts": _MOE,
    "grouped_gemm": _MOE, "gather": _LOCAL,
    "local_colwise": _LOCAL, "local_rowwise": _LOCAL, "local_packed_rowwise": _LOCAL, "local": _LOCAL,
    "local_params": "parameters used as local tensors (attention sinks) are sharded by parameter name, not by module",
}
#: transformers styles the adapter runs with a style of its own (:mod:`.hf_styles`), in a model's own plan.
ADAPTER_STYLES = ("mla_kv_a_proj", "replicated_with_grad_allreduce")


def _model_plan(model: nn.Module) -> dict[str, Any]:
    """``model.tp_plan`` (transformers >= 5), else the class's ``_tp_plan`` plus ``config.base_model_tp_plan``."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    merged = _compat.hf_class_plans(model)[0]
    base_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    base_root = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    merged.update({f"{base_root}{key}": value for key, value in base_plan.items()})
    return merged


def _translate(value: Any, model: nn.Module) -> Any:
    if not isinstance(value, str):
        return value
    if value == "replicated_with_grad_allreduce":
        from lightning_parallel.adapters.hf.styles import SumGradientsOnUse

        return SumGradientsOnUse()
    if value in HF_STYLES:
        return HF_STYLES[value]
    rope_dim = getattr(_text_config(model), "qk_rope_head_dim", None)
    if value == "mla_kv_a_proj" and isinstance(rope_dim, int):
        from lightning_parallel.adapters.hf.styles import MlaKvAProj

        return MlaKvAProj(rope_dim)
    reason = REFUSED_STYLES.get(value, f"it is not a transformers style the suite knows ({', '.join(HF_STYLES)})")
    return RefusedStyle(value, type(model).__name__, reason)


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _matching(model: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """The entries whose pattern names a submodule of ``model``.

    transformers applies its plans module by module and passes over a pattern that names nothing (a dense MLP
    entry in a model whose layers are all experts, Llama 4's unprefixed duplicates) or a bare parameter (attention
    sinks, which its owner's ``local_params`` entry covers): so does the suite, for the model's own plan.
    """
    import fnmatch

    names = [name for name, _ in model.named_modules() if name]
    return {key: value for key, value in plan.items() if any(fnmatch.fnmatchcase(name, key) for name in names)}


def _base_prefix(model: nn.Module) -> str:
    """The base model's path inside ``model`` (``"model"`` for ``LlamaForCausalLM``; ``""`` when it is one)."""
    base = getattr(model, "base_model", model)
    return next((name for name, sub in model.named_modules() if sub is base), "")


def hf_tensor_plan(prefix: str, model: nn.Module, *, sequence_parallel: bool = False) -> tuple[str, dict[str, Any]]:
    """The plan of the Hugging Face ``model`` held at ``prefix``, keyed by names inside the LightningModule.

    Args:
        prefix: the model's attribute path in the LightningModule (``""`` when it is the model).
        model: the ``PreTrainedModel``.
        sequence_parallel: add the entries that shard the residual stream along the sequence.

    Returns:
        ``(source, plan)``: a description for messages and ``{pattern: suite style name, None
        or RefusedStyle}``.

    Raises:
        ValueError: ``sequence_parallel`` on a model the suite cannot shard along the sequence.
    """
    source = f"the tp_plan of {type(model).__name__}" + (f" (at {prefix!r})" if prefix else "")
    plan = {key: _translate(value, model) for key, value in _matching(model, _model_plan(model)).items()}
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    tied = (
        isinstance(inputs, nn.Embedding) and outputs is not None and getattr(outputs, "weight", None) is inputs.weight
    )
    embed = next((name for name, sub in model.named_modules() if sub is inputs), None)
    if plan and tied and embed is not None and embed not in plan:
        # transformers < 5 plans leave the embedding out; the tied head would then be sharded alone.
        plan = {embed: "embedding_rowwise", **plan}
    plan.update(_on_sharded_features(model, plan))
    plan.update(_per_head_parameters(model, plan))
    if plan and sequence_parallel:
        plan.update(sequence_parallel_entries(model, plan))
    root = f"{prefix}." if prefix else ""
    return source, {f"{root}{key}": value for key, value in plan.items()}


#: Children that compute on the output of a column-sharded sibling projection: per-head norms after ``q_proj`` /
#: ``k_proj``, an activation with parameters after ``gate_proj`` / ``up_proj`` (Apertus's xIELU).
_ON_SHARDED_OUTPUT = ("q_norm", "k_norm", "act_fn")


def _on_sharded_features(model: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """Gradient sums for parameters that see only this rank's features and that the model's plan leaves out.

    A per-head norm or a parametric activation next to a ``colwise`` projection (sharded output) runs on this
    rank's heads or features only, with its whole weight: its gradient is this rank's share and the ranks'
    shares must be summed -- what ``replicated_with_grad_allreduce`` says where transformers' plan remembers it
    (Qwen3), and what it forgets in others (measured before: Param2MoE's ``k_norm`` 3e-4 off one process,
    Apertus's ``act_fn.alpha_p`` 1e-4, after 4 steps under tensor 2).
    """
    import fnmatch

    from lightning_parallel.adapters.hf.styles import SumGradientsOnUse

    names = [name for name, _ in model.named_modules() if name]
    sharded = {name.rsplit(".", 1)[0] for key, value in plan.items() if value == "colwise"
               for name in names if "." in name and fnmatch.fnmatchcase(name, key)}
    entries: dict[str, Any] = {}
    for parent in sorted(sharded):
        for child in _ON_SHARDED_OUTPUT:
            name = f"{parent}.{child}"
            sub = getattr(model.get_submodule(parent), child, None)
            if (isinstance(sub, nn.Module) and any(True for _ in sub.parameters())
                    and not any(fnmatch.fnmatchcase(name, key) for key in plan)):
                entries[name] = SumGradientsOnUse()
    return entries


def _per_head_parameters(model: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """Refusals for modules holding a parameter of one entry per head next to their column-sharded projections,
    that the plan leaves whole (Doge's ``A``): each rank computes only its heads, and would meet all of them
    (measured before: "The size of tensor a (2) must match the size of tensor b (4)" on every rank, after start)."""
    import fnmatch

    config = _text_config(model)
    counts = {getattr(config, key, None) for key in ("num_attention_heads", "num_key_value_heads")} - {None}
    names = [name for name, _ in model.named_modules() if name]
    sharded = {name.rsplit(".", 1)[0] for key, value in plan.items() if value == "colwise"
               for name in names if "." in name and fnmatch.fnmatchcase(name, key)}
    entries: dict[str, Any] = {}
    for parent in sorted(sharded):
        if any(fnmatch.fnmatchcase(parent, key) for key in plan):
            continue  # the plan says what to do with it (transformers' local_params for attention sinks)
        held = [attr for attr, param in model.get_submodule(parent).named_parameters(recurse=False)
                if param.ndim >= 1 and param.shape[0] in counts]
        if held:
            entries[parent] = RefusedStyle(
                "(none: parameters per head)", type(model).__name__,
                f"{type(model.get_submodule(parent)).__name__} holds {held}, one entry per head, which no entry of the "
                "plan shards with the heads of its column-sharded projections: each rank would meet every head's "
                "entries with its own share of the heads")
    return entries


def _refuse_sequence(model: nn.Module, what: str) -> ValueError:
    return ValueError(
        f"sequence_parallel=True with {type(model).__name__}: {what}, so the suite cannot shard its sequence exactly. "
        "Set sequence_parallel=False (tensor parallelism alone still shards every layer), or define "
        "tensor_parallel_plan() on the LightningModule with the sequence-parallel entries the model needs."
    )


def _planned(plan: dict[str, Any], name: str, sub: nn.Module) -> bool:
    """Whether ``plan`` (glob patterns) shards the submodule ``name`` or something inside it."""
    import fnmatch

    names = [f"{name}.{inner}" if inner else name for inner, _ in sub.named_modules()]
    return any(value is not None and fnmatch.fnmatchcase(n, key) for key, value in plan.items() for n in names)


def _layer_entries(model: nn.Module, plan: dict[str, Any], name: str, layer: nn.Module) -> dict[str, str]:
    """Entries of one decoder layer: norms on the slice, planned blocks gather the sequence on entry."""
    if any(True for _ in layer.parameters(recurse=False)):
        raise _refuse_sequence(model, f"{name} ({type(layer).__name__}) holds parameters of its own")
    entries = {}
    for child_name, child in layer.named_children():
        qualified = f"{name}.{child_name}"
        if is_norm(child):
            entries[qualified] = "sequence_local"
        elif any(True for _ in child.parameters()):
            if not _planned(plan, qualified, child):
                raise _refuse_sequence(
                    model, f"{qualified} ({type(child).__name__}) has parameters but no plan entry: it would see only "
                    "this rank's slice of the sequence and its weight gradient would miss the other ranks' tokens")
            entries[qualified] = "gather_input"
    return entries


def _at(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def sequence_parallel_entries(model: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """Entries (relative to ``model``) that shard a decoder's residual stream along the sequence.

    Args:
        model: the Hugging Face model.
        plan: its translated plan (relative to ``model``).

    Raises:
        ValueError: the model is not laid out as ``embed_tokens`` / ``layers`` / ``norm``, or a
            module with parameters would run on the sequence slice unplanned (named, with its class).
    """
    base_name = _base_prefix(model)
    base = model.get_submodule(base_name) if base_name else model
    layers, norm, embed = (getattr(base, attr, None) for attr in ("layers", "norm", "embed_tokens"))
    if not (isinstance(layers, nn.ModuleList) and len(layers) and isinstance(norm, nn.Module) and is_norm(norm)
            and isinstance(embed, nn.Embedding)):
        raise _refuse_sequence(model, "it is not a decoder laid out as embed_tokens / layers / norm")
    known = {"embed_tokens", "layers", "norm"}
    extra = [
        _at(base_name, n) for n, c in base.named_children() if n not in known and any(True for _ in c.parameters())
    ]
    head = model.get_output_embeddings()
    extra += [
        n for n, c in model.named_children() if c is not base and c is not head and any(True for _ in c.parameters())
    ]
    if extra:
        raise _refuse_sequence(model, f"{', '.join(extra)} hold parameters outside the decoder layers the suite shards")
    embed_name = _at(base_name, "embed_tokens")
    # The embedding output stays whole: the model builds its causal mask and rotary positions
    # from its length, which must be the global sequence, not this rank's slice.
    entries: dict[str, Any] = {_at(base_name, "layers.0"): "scatter_input", _at(base_name, "norm"): "sequence_local"}
    if plan.get(embed_name) == "embedding_rowwise":
        entries[embed_name] = "embedding_rowwise_replicated"
    elif plan.get(embed_name) is not None:
        raise _refuse_sequence(model, f"{embed_name} has the style {plan[embed_name]!r}, whose output is not whole")
    for index, layer in enumerate(layers):
        entries.update(_layer_entries(model, plan, _at(base_name, f"layers.{index}"), layer))
    return entries


_QUERY = ("q_proj", "qkv_proj", "query_key_value", "c_attn", "q_b_proj", "kv_b_proj")  # *_b_proj: MLA
_KEY_VALUE = ("k_proj", "v_proj")


def hf_head_dimensions(model: nn.Module, plan: dict[str, Any]) -> list[tuple[str, int]]:
    """Head counts from the HF config that ``plan`` splits across tensor ranks, as ``(description, size)``.

    A column-sharded query projection with a sharded output splits the attention heads and a
    key/value projection the key/value heads; a rank must hold whole heads, which projection
    widths alone do not show (4 ranks over 2 key/value heads of width 8 give a divisible 16).

    Args:
        model: the Hugging Face model.
        plan: ``{submodule name: ParallelStyle}`` from ``concrete_plan``.
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    config = _text_config(model)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    split = {name.rsplit(".", 1)[-1] for name, style in plan.items()
             if isinstance(style, ColwiseParallel) and style.output_layouts == (Shard(-1),)}
    dims = []
    kind = type(config).__name__
    if isinstance(heads, int) and split & set(_QUERY):
        dims.append((f"{kind} has num_attention_heads={heads} (attention heads)", heads))
    if isinstance(kv_heads, int) and split & set(_KEY_VALUE):
        dims.append((f"{kind} has num_key_value_heads={kv_heads} (key/value heads)", kv_heads))
    return dims


def hf_untied_embeddings(model: nn.Module) -> Optional[str]:
    """A description of a Hugging Face model whose config ties the embeddings but whose weights are two tensors.

    ``parallelize_module`` and ``to_empty`` (materialising a ``meta`` model) both replace
    parameters one module at a time, which unties ``tie_word_embeddings`` silently; this
    checks the config's promise against the module. None when the model is tied, not
    tied by its config, or one of the two lives on another pipeline stage.
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    weights = [getattr(m, "weight", None) for m in (inputs, outputs)]
    if not getattr(config, "tie_word_embeddings", False) or not all(isinstance(w, nn.Parameter) for w in weights):
        return None
    if weights[0] is weights[1]:
        return None
    return (f"{type(model).__name__} has tie_word_embeddings=True, but its input embedding and LM head hold two "
            "different weights")
