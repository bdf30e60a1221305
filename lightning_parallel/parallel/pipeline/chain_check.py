"""One-process pre-flight check: does the pipeline's layer chain compute what ``forward`` computes?

A pipeline runs the layers one after another; the module's ``forward`` may do more (a
scaling between blocks, a layer the list forgot, a mask). Such a mismatch trains
silently wrong under every pipeline layout, so before the split the chain is run on one
small input in this process -- all layers in one stage module, exactly as the stages
will run them -- and compared with ``forward``.

Note:
    The check needs real weights and an input: it is skipped on the ``meta`` device (the
    launcher's preflight) and runs again where the strategy parallelises the materialised
    module. Hugging Face models use a tiny synthetic batch built from the config (one row
    padded); protocol modules use ``example_input_array`` when they set it, and are not
    checked otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import Tensor, nn

ATOL, RTOL = 1e-5, 1e-4


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` lives on the meta device (nothing can be computed)."""
    return any(p.is_meta for p in module.parameters())


def run_chain(named_layers: Sequence[tuple[str, nn.Module]], make_stage: Callable[..., nn.Module], inputs: Any) -> Any:
    """Run every layer as one stage module would, on the whole of ``inputs``."""
    stage = make_stage(list(named_layers))
    args, kwargs = stage.stage_arguments(inputs)
    return stage(*args, **kwargs)


def check_chain(
    module: nn.Module,
    named_layers: Sequence[tuple[str, nn.Module]],
    make_stage: Callable[..., nn.Module],
    sample: Callable[[], tuple[Any, Any]],
    source: str,
) -> None:
    """Raise a ``ValueError`` when the layer chain and ``forward`` disagree on one input.

    Args:
        module: the whole module (put in eval mode for the check, so dropout cannot differ).
        named_layers: ``(qualified name, layer)`` of every pipeline layer, in order.
        make_stage: the stage factory the split will use.
        sample: ``() -> (inputs, forward's output)``.
        source: who defined the layers (``"protocol"`` or a model class), for the message.
    """
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            inputs, expected = sample()
            chained = run_chain(named_layers, make_stage, inputs)
    finally:
        module.train(was_training)
    got, want = _tensors(chained), _tensors(expected)
    if len(got) != len(want) or any(a.shape != b.shape for a, b in zip(got, want)):
        shapes = ([tuple(t.shape) for t in got], [tuple(t.shape) for t in want])
        raise ValueError(_message(module, source, f"outputs of shapes {shapes[0]} instead of forward's {shapes[1]}"))
    worst = max(((a.float() - b.float()).abs().max().item() for a, b in zip(got, want)), default=0.0)
    if not all(torch.allclose(a.float(), b.float(), atol=ATOL, rtol=RTOL) for a, b in zip(got, want)):
        raise ValueError(_message(module, source, f"a result {worst:.3g} (max |difference|) away from forward's"))


def _message(module: nn.Module, source: str, what: str) -> str:
    who = "pipeline_layers()" if source == "protocol" else f"the pipeline plan of {source}"
    return (
        f"The pipeline layer chain of {type(module).__name__} (from {who}) gives {what} on one input: a pipeline would "
        "train a different model. Fix: list every block forward runs, in forward's order, and move any computation "
        "forward does between blocks (a scaling, a mask, a skipped or repeated layer) into a block; or define "
        "pipeline_layers() on the module."
    )
