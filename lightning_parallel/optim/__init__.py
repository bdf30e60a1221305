"""Optimizers whose update reads whole matrices, made exact under every layout of the suite.

:class:`MuonWithAdamW` (Muon on hidden matrices, AdamW on the rest) and :func:`muon_groups` (its parameter groups for
any model). Element-wise optimizers (SGD, Adam, AdamW, ...) need nothing here: they step on each rank's shard as
they are (:mod:`lightning_parallel.parallel.local_step`).
"""

from lightning_parallel.optim.muon import MuonWithAdamW, muon_groups

__all__ = ["MuonWithAdamW", "muon_groups"]
