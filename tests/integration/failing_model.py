"""A GPT recipe model that fails in chosen ranks after the process group started, its cause behind a wrapper (for
the console's error line: root cause, once per run; test_user_mistakes.py)."""

import torch.distributed as dist
from hydra.errors import InstantiationException
from lightning_parallel.examples.nlp.model import GPT

CAUSE = "the real cause: set data.something=1"


class FailingGPT(GPT):
    """:class:`GPT` that raises in ``setup`` on the ranks in ``fail_on_ranks`` (Hydra's wrapper around a
    ``ValueError``, as an error inside ``instantiate`` reaches the entry point)."""

    def __init__(self, fail_on_ranks=(0, 1), **kwargs):
        super().__init__(**kwargs)
        self.fail_on_ranks = tuple(fail_on_ranks)

    def setup(self, stage):
        if dist.get_rank() in self.fail_on_ranks:
            try:
                raise ValueError(CAUSE)
            except ValueError as cause:
                raise InstantiationException("Error in call to target 'tests.integration.FailingGPT':") from cause
        super().setup(stage)
