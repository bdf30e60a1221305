"""Test-only callback for ``lp-train`` runs of ``experiment=hf_finetune``: every rank writes its losses to a file."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_parallel.testing import LossHistory


class RankLosses(LossHistory):
    """:class:`LossHistory` that writes ``folder/rank<R>.json`` (``reduced`` and ``local`` losses) at the fit's end.

    Args:
        folder: where the files go (one per rank).
    """

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = Path(folder)

    def on_fit_end(self, trainer, pl_module) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {"reduced": self.losses, "local": self.local_losses}
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
