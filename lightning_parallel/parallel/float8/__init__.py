"""FP8 training through torchao (``ParallelOptions.float8``, docs/float8.md): :mod:`.checks` (the options, before any
process), :mod:`.choice` (which Linear layers compute in FP8, on the whole model), :mod:`.convert` (step 1b of
:func:`~lightning_parallel.parallel.compose.parallelize`: ``Float8Linear``, FP8 all-gather, FP8 tensor styles)."""

from lightning_parallel.parallel.float8.checks import RECIPES, check_float8_device, check_float8_options
from lightning_parallel.parallel.float8.choice import Float8Choice, choose_float8_layers

__all__ = ["RECIPES", "Float8Choice", "check_float8_device", "check_float8_options", "choose_float8_layers"]
