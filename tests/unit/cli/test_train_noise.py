"""lp-train filters the lines of others a user cannot act on, once, with a reason (cli/train.py)."""

import importlib
import logging
import warnings


def _reloaded_train():
    from lightning_parallel.cli import train

    return importlib.reload(train)  # its filters are installed at import (pytest resets warning filters per test)


def test_lightnings_leafspec_deprecation_is_filtered():
    _reloaded_train()
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ... instead.", FutureWarning, stacklevel=1)
        warnings.warn("another deprecation", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["another deprecation"]


def test_lightnings_cloud_tips_are_dropped_and_its_other_lines_kept():
    _reloaded_train()
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")

    def kept(message):
        record = logging.LogRecord(logger.name, logging.INFO, __file__, 1, message, None, None)
        return all(f.filter(record) for f in logger.filters)

    assert not kept("💡 Tip: For seamless cloud uploads and versioning, try installing [litmodels](...)")
    assert not kept("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger](...)")
    assert kept("`Trainer.fit` stopped: `max_steps=3` reached.")
