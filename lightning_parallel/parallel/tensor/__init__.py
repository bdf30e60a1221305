"""Tensor parallelism on DTensor (``parallelize_module``), one job per module:

* :mod:`.plan` -- resolve a module's plan (globs, style names, sequence and loss parallelism)
  and apply it to the submodules a rank holds;
* :mod:`.validation` -- check a resolved plan against the tensor size before any process group exists;
* :mod:`.styles` -- what each style name becomes as a torch ``ParallelStyle``;
* :mod:`.ties` -- tied weights kept one parameter through ``parallelize_module``.
"""
