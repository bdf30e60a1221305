"""The parallel machinery: pure torch (and DeepSpeed), no Lightning inside.

Each submodule applies one parallelism and takes the mesh or process group it works on
as an argument; nothing here keeps a global. Import the submodule you need
(``from lightning_parallel.parallel import tensor``): this package imports none of them
eagerly, so importing it stays cheap.
"""
