"""Test-only models with a deliberate layout bug, for ``lp-compare``'s negative controls."""

from examples.nlp.model import GPT


class SummedMicrobatchGPT(GPT):
    """A GPT whose pipeline loss sums the micro-batch losses instead of averaging them.

    The pipeline divides each micro-batch's ``pipeline_loss_terms`` sum by the global batch's item
    count; this one returns each micro-batch's sum times the number of micro-batches, so a pipelined
    step trains on the *sum* of micro-batch means (loss and gradients ``microbatches`` times too large).
    Unpipelined layouts call ``training_step``, which is correct.
    """

    def __init__(self, microbatches: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.microbatches = microbatches

    def pipeline_loss(self, output, target):
        return super().pipeline_loss(output, target) * self.microbatches

    def pipeline_loss_terms(self, output, target):
        loss_sum, num_items = super().pipeline_loss_terms(output, target)
        return loss_sum * self.microbatches, num_items

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss_sum, num_items = GPT.pipeline_loss_terms(self, self(inputs), targets)  # the recipe's own, unscaled
        loss = loss_sum / num_items
        self.log("train_loss", loss)
        return loss


class UnsyncedNormGPT(GPT):
    """A GPT whose tensor plan forgets the second norm of every block under sequence parallelism.

    With ``sequence_parallel=True`` each tensor rank runs ``ln2`` on its slice of the sequence; without
    the plan's ``"sequence"`` entry its weight is a plain tensor whose gradient is never summed over the
    tensor group, so each rank's ``ln2`` weights drift apart from the single-process ones.
    """

    def tensor_parallel_plan(self):
        return {k: v for k, v in super().tensor_parallel_plan().items() if k != "blocks.*.ln2"}
