"""The parallel machinery: pure torch and torch.distributed, no Lightning inside.

Read it in the order :func:`~lightning_parallel.parallel.compose.parallelize` applies it:

1. :mod:`.pipeline` -- split into stages, keep this rank's layers;
2. :mod:`.tensor` -- DTensor styles on the submodules this rank holds;
3. :mod:`.activation_checkpoint` -- recompute this rank's layers in backward;
4. :mod:`.precision` -- the mixed-precision policy handed to the data axis;
5. :mod:`.data` -- FSDP2 over the data axis (replicated, ZeRO-2/3, HSDP);

with :mod:`.options` (the run's options, validated once) and :mod:`.grad_norm_clipping` (clipping over every
axis). Each submodule takes the mesh or process group it works on as an argument; nothing here keeps
a global, and nothing here imports :mod:`lightning_parallel.adapters`: the model's answers come in as
arguments. This package imports none of its submodules eagerly, so importing it stays cheap.
"""
