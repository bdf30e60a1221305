"""Coverage matrix of Hugging Face causal-LM families under the suite's layouts (issue 29).

    python -m benchmarks.hf_coverage                          # every family, every layout; writes docs/hf-coverage.md
    python -m benchmarks.hf_coverage --families llama,phi3    # a few families (docs untouched unless --docs)
    python -m benchmarks.hf_coverage --layouts tp2,pp2        # a few layouts
    python -m benchmarks.hf_coverage --optimizers adamw       # the AdamW columns alone

Every causal-LM model type of the installed transformers whose config carries a tensor or pipeline plan is
built from its config class at a tiny size (:mod:`.tiny`) and trained a few steps under tensor 2, pipeline 2,
pipeline 2 x tensor 2, data 2 ZeRO-2 and (families whose config carries ``base_model_ep_plan``) data 2 x expert 2
against one process (:mod:`.cells`); the two pretrained columns (:mod:`.pretrained`) start from a
``save_pretrained`` folder under tensor 2 and data 2 x expert 2, each rank reading its slices, against one process
started from ``from_pretrained``, and export the trained checkpoint back to a folder ``from_pretrained`` reads.
Each cell is PARITY with its figure, REFUSED before start with the cause, or a DEFECT (:mod:`.table`). The plain
columns run again under AdamW (:mod:`.optimizers`, :mod:`.adamw`), each cell beyond the tolerance judged against the
family's floor under the layout's own arithmetic (:mod:`.arithmetic`, :mod:`.floor`). The JSON goes to
``benchmarks/results/<date>/hf_coverage/results.json`` (with every cell's losses and the refusal messages),
the table to ``docs/hf-coverage.md``. Families that cannot be built from a config alone (multimodal
wrappers, configs that need more than a size) are listed with the reason.
"""

from benchmarks.hf_coverage.run import CI_SAMPLE, run_matrix

__all__ = ["CI_SAMPLE", "run_matrix"]
