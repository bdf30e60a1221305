"""Layouts simulated at the scale users run them: every rank class of a world built in one CPU process (issue 41).

:func:`simulate` runs the suite's real composition (``options.layout`` -> ``RunMeshes.build`` -> ``check_module``
-> ``parallelize``) under torch's fake process group on a ``meta`` model, once per class of ranks holding the same
shapes (:mod:`.classes`), and reports what each class stores (:mod:`.held`), its predicted peak (:mod:`.result`) and
the whole-world check (:mod:`.whole_world`). ``lp-simulate`` is its command (:mod:`lightning_parallel.cli.simulate`).
"""

from lightning_parallel.planner.simulation.result import ClassResult, Simulation
from lightning_parallel.planner.simulation.simulate import simulate
from lightning_parallel.planner.simulation.whole_world import WholeWorldError, check_whole_world

__all__ = ["ClassResult", "Simulation", "WholeWorldError", "check_whole_world", "simulate"]
