"""The fp32 floor of a family: how far one process drifts from itself when only the order of its sums changes.

Some families amplify fp32 rounding over a few SGD steps at the matrix's learning rate (measured: Gemma 4's text
model 9.5e-6, Gemma 4 unified 4.4e-5, Llama 7e-9 in the distance below). For them "within 1e-5 of one process
after 4 steps" cannot separate a layout from rounding: one process whose global batch is split in two halves
whose gradients are summed (the arithmetic of data parallelism, no communication, no suite code) ends as far from
the unsplit process as the layouts do. :func:`fp32_floor` measures that distance with a plain torch loop and the
recipe's objective (the summed token loss over the global batch's valid-token count), so a cell can be judged
by what is measurable: its parameters after the first step, before rounding has been amplified
(:func:`~.table.verdict`).
"""

from __future__ import annotations

import torch

from benchmarks.hf_coverage import cells


def _steps(model_type: str, halves: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = cells.TinyFamily(model_type).build().model
    model.train()
    batches = cells.padded_batches()
    optimizer = torch.optim.SGD(model.parameters(), lr=cells.LR)
    for step in range(cells.STEPS):
        batch = {k: torch.stack([s[k] for s in batches[step * cells.GLOBAL_BATCH:(step + 1) * cells.GLOBAL_BATCH]])
                 for k in batches[0]}
        labels = batch["labels"][:, 1:]
        valid = (labels != -100).sum()
        half = cells.GLOBAL_BATCH // 2
        parts = [slice(0, half), slice(half, None)] if halves else [slice(None)]
        optimizer.zero_grad()
        for part in parts:
            logits = model(input_ids=batch["input_ids"][part], attention_mask=batch["attention_mask"][part]).logits
            logits = logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[part].reshape(-1),
                                                     ignore_index=-100, reduction="sum")
            (loss / valid).backward()
        optimizer.step()
    return {name: p.detach().double().clone() for name, p in model.named_parameters()}


def fp32_floor(model_type: str) -> float:
    """The largest final-parameter difference between one process on whole global batches and one process on
    their two halves (gradients summed), after the matrix's steps at its learning rate."""
    whole, halves = _steps(model_type, False), _steps(model_type, True)
    return max(float((whole[name] - halves[name]).abs().max()) for name in whole)
