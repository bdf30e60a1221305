"""transformers' tensor-parallel style names, as the suite's styles of the same numerics.

A plan may name a style the way ``transformers`` does (``colwise_gather_output``, ``rowwise_split_input``):
in a Hugging Face model's own ``tp_plan`` and in a user's ``plan=`` override alike. This is vocabulary
only -- which model holds which plan is the adapter's business (:mod:`lightning_parallel.adapters.hf.tensor`);
a style the suite cannot run becomes a :class:`RefusedStyle` that raises only if nothing replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# transformers style name -> the suite's style name of the same numerics (None: nothing to do).
HF_STYLES: dict[str, Optional[str]] = {
    "colwise": "colwise",  # weight Shard(0), replicated input, local output sharded on the last dim
    "rowwise": "rowwise",  # weight Shard(1), input sharded on the last dim, output all-reduced
    # transformers >= 5.25 plans q/k/v and o_proj "by unit" (whole heads per rank), replicating heads
    # when the tensor size exceeds or does not divide the head count. Where it divides, that is colwise
    # and rowwise exactly; hf_head_dimensions refuses the other sizes before anything runs, so the
    # replicated-head layout (a 2-D sub-mesh no public torch style gives) is never approximated.
    "unit_colwise": "colwise",
    "unit_rowwise": "rowwise",
    "colwise_rep": "colwise_gather",  # colwise, output all-gathered
    "colwise_gather_output": "colwise_gather",
    "rowwise_rep": "rowwise_replicated_input",  # rowwise on a whole input: each rank slices its rows
    "rowwise_split_input": "rowwise_replicated_input",
    "embedding_rowwise": "embedding_rowwise",  # vocabulary rows sharded, partial lookups summed
    "embedding_colwise": "embedding_colwise",  # features sharded, output gathered
    "sequence_parallel": "sequence_local",  # a norm on the sequence slice (needs sequence_parallel=True)
    "replicated_with_grad_allreduce": "replicated_grad_sum",  # per-head norms: whole weight, gradients summed
    "replicate": None,  # every rank keeps the whole parameter: what an unplanned module does
}


@dataclass(frozen=True)
class RefusedStyle:
    """A transformers style the suite cannot run; resolving a plan that still holds it raises.

    Attributes:
        hf_style: the transformers style name.
        model: the class name of the Hugging Face model whose plan holds it.
        reason: why, and the user-side remedy.
    """

    hf_style: str
    model: str
    reason: str

    def error(self, name: str) -> ValueError:
        """The error for the plan entry ``name``."""
        return ValueError(
            f"{self.model}'s tensor-parallel plan gives {name!r} the transformers style {self.hf_style!r}, which the "
            f"suite cannot run: {self.reason}. Replace or remove the entry with the strategy's plan= "
            f"(plan={{{name!r}: None}} or another style), or define tensor_parallel_plan() on the LightningModule."
        )


def suite_style(value: Any) -> Any:
    """A transformers style name given in a user's plan, as the suite's name (other values unchanged)."""
    return (
        HF_STYLES.get(value, value) if isinstance(value, str) and value in HF_STYLES and value != "replicate" else value
    )

