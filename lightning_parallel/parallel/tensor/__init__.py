"""Tensor parallelism on DTensor (``parallelize_module``), one job per module:

* :mod:`.plan` -- resolve a module's plan (globs, style names, sequence and loss parallelism),
  validate it against the tensor size, apply it to the submodules a rank holds;
* :mod:`.styles` -- what each style name becomes as a torch ``ParallelStyle``;
* :mod:`.ties` -- tied weights kept one parameter through ``parallelize_module``.
"""
