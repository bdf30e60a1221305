"""``torch.compile`` per layer, torchtitan's recipe: each transformer block is compiled on its own.

Why per block and not the whole model: a block is the unit every other parallelism already cuts at
(pipeline stages hold whole blocks, FSDP2 units are blocks, activation checkpointing recomputes
blocks), so a compiled block composes with all of them -- a whole-model graph would have to be cut
again at every stage boundary, FSDP2 hook and tensor-parallel redistribution. The blocks of a model run
the same code with different parameters: dynamo treats a module's parameters as graph inputs
(``inline_inbuilt_nn_modules``, torch's default), so one compiled graph serves every block and the
compile time does not grow with depth.

The place in :func:`~lightning_parallel.parallel.compose.parallelize` is torchtitan's: after tensor
parallelism and activation checkpointing (the compiled graph holds the sharded layer's collectives and
the recomputation), before FSDP2 (its hooks stay outside the graph, on the block's ``__call__``).
``nn.Module.compile`` compiles in place, so parameter names, checkpoints and the pipeline's layer chain
are unchanged.

fp32 parity with eager is close but not bitwise: inductor fuses element-wise chains and reorders
reductions, a rounding difference of about 1e-7 relative per op that AdamW steps carry on
(``tests/distributed/strategies/test_compile_parity.py`` states the bound it holds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

from torch import nn

Compile = Union[bool, str]


def compile_backend(choice: Compile) -> str:
    """The ``torch.compile`` backend ``choice`` names: ``True`` is inductor, a string one of
    ``torch.compiler.list_backends``.

    Args:
        choice: ``ParallelOptions.compile`` (``False`` is refused here: nothing to compile).

    Raises:
        ValueError: not a bool or a backend torch knows (the message lists them).
    """
    import torch

    if choice is True:
        return "inductor"
    known = torch.compiler.list_backends(exclude_tags=())
    if not isinstance(choice, str) or choice not in known:
        import difflib

        # torch's *_TESTING_ONLY backends exist to fail on purpose: never offered.
        offered = sorted(b for b in known if not b.endswith("_TESTING_ONLY"))
        near = difflib.get_close_matches(str(choice), offered, n=1)
        hint = f"did you mean compile={near[0]!r}? " if near else ""
        raise ValueError(f"compile={choice!r}: {hint}use True (inductor), False, or a torch.compile backend "
                         f"({', '.join(offered)}).")
    return choice


def check_compile(choice: Compile, activation_checkpointing: object, tensor_parallel_size: object) -> None:
    """Refuse ``compile`` beside activation checkpointing under tensor parallelism, which torch 2.13 cannot compile.

    Measured on the GPT recipe under tensor 2 with full checkpointing: compiling over the checkpoint fails in AOT
    autograd ("expected all tensors_saved_with_vc_check to be Tensors", a ``DeviceMesh`` among the saved values),
    and compiling inside it recurses without end in the backward's proxy tracing. Each pair alone trains to eager's
    losses (``tests/distributed/strategies/test_compile_parity.py``).

    Args:
        choice: ``ParallelOptions.compile``.
        activation_checkpointing: ``ParallelOptions.activation_checkpointing``.
        tensor_parallel_size: ``ParallelOptions.tensor_parallel_size`` (``"auto"`` is not checked here).

    Raises:
        ValueError: the three together, naming the two ways out.
    """
    if choice is not False and activation_checkpointing != "none" and isinstance(tensor_parallel_size, int) \
            and tensor_parallel_size > 1:
        raise ValueError(
            f"compile={choice!r} with activation_checkpointing={activation_checkpointing!r} under "
            f"tensor_parallel_size={tensor_parallel_size} does not compile in torch's AOT autograd (a DeviceMesh "
            "among the tensors saved for backward): drop activation_checkpointing (compiled blocks hold fewer "
            "activations), or compile=false."
        )


def compile_layers(layers: Sequence[nn.Module], choice: Compile) -> list[nn.Module]:
    """Compile each of ``layers`` in place with ``choice``'s backend; returns them.

    Args:
        layers: this rank's blocks (placeholders of other pipeline stages left out by the caller).
        choice: ``True`` or a backend name (see :func:`compile_backend`).
    """
    import torch

    backend = compile_backend(choice)
    # A fresh compiler state per parallelised model, as in a fresh process: compiled code cached from an earlier
    # model of this process under another layout (tensor parallel, then checkpointed under FSDP2 ZeRO-3 and
    # pipelining) made dynamo's backward tracing recurse without end (measured; each alone trains). Other compiled
    # functions of the process recompile on their next call.
    torch.compiler.reset()
    for layer in layers:
        # The forward only, not ``nn.Module.compile``'s whole ``__call__``: the hooks FSDP2 registers later (gather
        # before forward, reduce after backward) must run outside the graph.
        layer.forward = torch.compile(layer.forward, backend=backend)
    return list(layers)
