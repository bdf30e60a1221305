"""The layout planner: candidate layouts -> predicted memory and step time -> a ranked table (``lp-plan``).

Pure arithmetic over a model's shape (:mod:`.shapes`, :mod:`.profile`), a cluster description
(:mod:`.cluster`, ``conf/cluster/``) and the layouts the strategies can run (:mod:`.candidates`):
bytes per rank (:mod:`.memory`), step time with the pipeline schedule simulated from torch's
action lists (:mod:`.schedule_sim`, :mod:`.predict`), ranking (:mod:`.plan`). Measuring is optional
and goes through the normal entry point (``lp-plan --measure``); ``strategy=planned``
(:mod:`.planned`) applies the choice at start-up. :func:`simulate` (``lp-simulate``, :mod:`.simulation`) builds
every rank class of a layout in torch's fake world and reports its bytes as stored, and the collectives and
activations of one step on ``meta``. Nothing here imports the strategies or the Trainer.
"""

from lightning_parallel.planner.candidates import Candidate, Rejected, SearchSpace, Workload, enumerate_layouts
from lightning_parallel.planner.cluster import Cluster, load_cluster
from lightning_parallel.planner.plan import Plan, make_plan, overrides
from lightning_parallel.planner.shapes import LayerShape, ModelShape, Param, llama3_shape
from lightning_parallel.planner.simulation import Simulation, simulate

__all__ = ["Candidate", "Cluster", "LayerShape", "ModelShape", "Param", "Plan", "Rejected", "SearchSpace", "Simulation",
           "Workload", "enumerate_layouts", "llama3_shape", "load_cluster", "make_plan", "overrides", "simulate"]
