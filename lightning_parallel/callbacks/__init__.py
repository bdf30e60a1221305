"""Lightning callbacks of the suite."""

from lightning_parallel.callbacks.evaluation import EvaluationReport
from lightning_parallel.callbacks.exact_resume import ExactDataResume
from lightning_parallel.callbacks.hf_weights import HuggingFaceWeights
from lightning_parallel.callbacks.nonfinite import NonFiniteGuard
from lightning_parallel.callbacks.pipeline_bubble import PipelineBubble
from lightning_parallel.callbacks.rank_record import RankRecorder
from lightning_parallel.callbacks.run_scalars import RunScalars
from lightning_parallel.callbacks.step_seeds import StepSeeds
from lightning_parallel.callbacks.throughput import ThroughputReport

__all__ = [
    "EvaluationReport", "ExactDataResume", "HuggingFaceWeights", "NonFiniteGuard", "PipelineBubble", "RankRecorder",
    "RunScalars", "StepSeeds", "ThroughputReport",
]
