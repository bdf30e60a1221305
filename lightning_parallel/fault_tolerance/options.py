"""What ``strategy.fault_tolerance`` says: replica groups, the lighthouse, timeouts and the rescaling rule.

Pure data and validation, no torchft import: a bad value is a ``ValueError`` at construction, before any process
or manager exists.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

MODES = ("ddp", "local_sgd", "diloco", "streaming_diloco")
DILOCO_MODES = ("diloco", "streaming_diloco")
EXCHANGES = ("fp32", "bf16")
LR_RULES = ("linear", "sqrt", "none")

# The environment torchft's own launchers (torchx, torchtitan) use; lp-train sets the same names.
ENV_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
ENV_REPLICA_GROUP = "REPLICA_GROUP_ID"
ENV_NUM_REPLICA_GROUPS = "NUM_REPLICA_GROUPS"


@dataclass(frozen=True)
class FaultTolerance:
    """Per-step fault tolerance across data-parallel replica groups (torchft).

    Each replica group is an ordinary run of the strategy -- any pipeline x tensor x ZeRO layout on its own
    processes, started by its own ``torchrun`` -- and the replica groups average gradients through torchft's
    manager, which survives a group that dies and heals one that comes back from a healthy peer.

    Args:
        replicas: replica groups the run is planned for (the data order and the learning-rate rule refer to it).
            Default: ``$NUM_REPLICA_GROUPS``.
        replica_id: this group's index in ``[0, replicas)``. Default: ``$REPLICA_GROUP_ID``.
        lighthouse: the lighthouse's address (``http://host:port``). Default: ``$TORCHFT_LIGHTHOUSE``.
        min_replicas: fewest replica groups a step may commit with.
        mode: ``ddp`` (gradients averaged every step), ``local_sgd`` (parameters averaged every ``sync_every``
            steps), ``diloco`` (an outer optimizer steps on the pseudo-gradient averaged every ``sync_every``
            steps) or ``streaming_diloco`` (the same per fragment of the model, fragments at staggered steps).
        sync_every: steps between meetings under ``local_sgd`` and ``diloco``; under ``streaming_diloco`` each
            fragment meets every ``sync_every`` steps and a fragment meets every ``sync_every / fragments`` steps.
        outer_lr: the outer optimizer's learning rate (``diloco`` modes; the DiLoCo paper's 0.7).
        outer_momentum: its momentum (0.9).
        outer_nesterov: Nesterov momentum (the paper's outer optimizer); False for heavy-ball momentum.
        fragments: how many fragments ``streaming_diloco`` splits each rank's parameters into.
        exchange: the dtype the pseudo-gradients travel in across groups: ``fp32``, or ``bf16`` (half the bytes;
            ``diloco`` modes).
        sync_delay: steps a meeting's exchange overlaps with inner training (``diloco`` modes; torchft's
            ``fragment_sync_delay``, the Streaming DiLoCo paper's tau): the pseudo-gradient is taken and its
            all-reduce started ``sync_delay`` steps before the meeting step, where the outer step lands. Shorter than
            the steps between two meetings.
        fragment_mix: at the meeting, the parameters become ``(1 - fragment_mix) * global + fragment_mix * local``
            (torchft's ``fragment_update_alpha``): 0 takes the outer step's result alone, dropping the
            ``sync_delay`` steps trained meanwhile; the paper mixes with 0.5.
        lr_rule: how the learning rate follows the number of replica groups in a step (``linear``:
            proportional, ``sqrt``, ``none``), as :mod:`lightning_parallel.scaling` rescales for a data-parallel size.
        timeout: seconds for a cross-replica collective, a commit vote or a recovery transfer.
        quorum_timeout: seconds to wait for a quorum before the run stops with an error.
        group_timeout: seconds the ranks of a group wait for each other before each quorum. A rank that hangs
            (rather than dies) keeps its group's manager heartbeating, and torchft's lighthouse forms no quorum
            without a majority of the heartbeating groups, so a hung group must fail first: shorter than
            ``quorum_timeout``.
        connect_timeout: seconds to reach the lighthouse before the run stops with an error.
        max_restarts: how often ``lp-train`` restarts a failed group on one node (a cluster's ``torchrun
            --max-restarts`` does it there).
        startup_wait: seconds a fresh start waits for every replica group before step 0 (then it starts with the
            groups present, and the others join as they come).
    """

    replicas: Optional[int] = None
    replica_id: Optional[int] = None
    lighthouse: Optional[str] = None
    min_replicas: int = 1
    mode: str = "ddp"
    sync_every: int = 20
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    fragments: int = 2
    exchange: str = "fp32"
    sync_delay: int = 0
    fragment_mix: float = 0.0
    lr_rule: str = "linear"
    timeout: float = 60.0
    quorum_timeout: float = 120.0
    group_timeout: float = 30.0
    connect_timeout: float = 10.0
    startup_wait: float = 60.0
    max_restarts: int = 3

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"fault_tolerance.mode={self.mode!r}: choose one of {', '.join(MODES)}.")
        if self.lr_rule not in LR_RULES:
            raise ValueError(f"fault_tolerance.lr_rule={self.lr_rule!r}: choose one of {', '.join(LR_RULES)}.")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"fault_tolerance.max_restarts={self.max_restarts!r} must be an integer >= 0.")
        for name in ("min_replicas", "sync_every", "fragments"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"fault_tolerance.{name}={value!r} must be a positive integer.")
        for name in ("timeout", "quorum_timeout", "group_timeout", "connect_timeout", "startup_wait"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) <= 0:
                raise ValueError(f"fault_tolerance.{name}={getattr(self, name)!r} must be a positive number.")

        self._check_outer()
        if self.group_timeout >= self.quorum_timeout:
            raise ValueError(f"fault_tolerance.group_timeout={self.group_timeout:g} must be shorter than "
                             f"quorum_timeout={self.quorum_timeout:g}: a group with a hung rank must fail before the "
                             f"others give up waiting for a quorum.")

    def _check_outer(self) -> None:
        """The ``diloco`` modes' outer optimizer, fragments and exchange dtype."""
        if self.exchange not in EXCHANGES:
            raise ValueError(f"fault_tolerance.exchange={self.exchange!r}: choose one of {', '.join(EXCHANGES)} (int8 "
                             f"is not built: torchft quantises only on CUDA with Triton).")
        if not isinstance(self.outer_lr, (int, float)) or self.outer_lr <= 0:
            raise ValueError(f"fault_tolerance.outer_lr={self.outer_lr!r} must be a positive number.")
        if not isinstance(self.outer_momentum, (int, float)) or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"fault_tolerance.outer_momentum={self.outer_momentum!r} must lie in [0, 1).")
        if self.outer_nesterov and self.outer_momentum == 0:
            raise ValueError("fault_tolerance.outer_nesterov=true needs outer_momentum > 0: set a momentum, or "
                             "outer_nesterov=false for plain SGD.")
        if self.mode == "streaming_diloco" and (self.sync_every % self.fragments or self.fragments < 2):
            raise ValueError(f"fault_tolerance.mode=streaming_diloco: fragments={self.fragments} must be at least 2 "
                             f"and divide sync_every={self.sync_every} (one fragment meets every sync_every / "
                             f"fragments steps); or use mode=diloco for the whole model at once.")
        between = self.sync_every // (self.fragments if self.mode == "streaming_diloco" else 1)
        if isinstance(self.sync_delay, bool) or not isinstance(self.sync_delay, int) or \
                not 0 <= self.sync_delay < between:
            raise ValueError(f"fault_tolerance.sync_delay={self.sync_delay!r} must be an integer in [0, {between}): "
                             f"an exchange must land before the next meeting's starts.")
        if not isinstance(self.fragment_mix, (int, float)) or not 0 <= self.fragment_mix <= 1:
            raise ValueError(f"fault_tolerance.fragment_mix={self.fragment_mix!r} must lie in [0, 1].")

    @classmethod
    def from_config(cls, value: Any) -> Optional[FaultTolerance]:
        """``None``/``False`` (off), a ``FaultTolerance``, or a mapping of its fields (a Hydra node).

        Args:
            value: what the strategy was given as ``fault_tolerance``.
        """
        if value is None or value is False:
            return None
        if isinstance(value, cls):
            return value
        if value is True:
            return cls()
        if not isinstance(value, Mapping) and not hasattr(value, "items"):
            raise ValueError(f"fault_tolerance={value!r}: give a mapping of FaultTolerance's fields, or null.")
        names = {f.name for f in fields(cls)}
        given = dict(value.items())
        unknown = sorted(set(given) - names)
        if unknown:
            raise ValueError(f"fault_tolerance got unknown key(s) {unknown}: the keys are {sorted(names)}.")
        return cls(**given)

    def resolved(self, environ: Optional[Mapping[str, str]] = None) -> FaultTolerance:
        """This, with replica group, group count and lighthouse filled from the environment; checked.

        Args:
            environ: where to read ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE``
                (default ``os.environ``).

        Raises:
            ValueError: a value missing from both the options and the environment, or out of range.
        """
        env = os.environ if environ is None else environ
        replicas = self.replicas if self.replicas is not None else _env_int(env, ENV_NUM_REPLICA_GROUPS, "replicas")
        replica_id = self.replica_id if self.replica_id is not None else _env_int(env, ENV_REPLICA_GROUP, "replica_id")
        lighthouse = self.lighthouse or env.get(ENV_LIGHTHOUSE)
        if not lighthouse:
            raise ValueError(f"fault_tolerance needs the lighthouse's address: set fault_tolerance.lighthouse or "
                             f"${ENV_LIGHTHOUSE} (lp-train starts one for a single-node run; `torchft_lighthouse "
                             f"--min_replicas 1` on a cluster, see docs/fault-tolerance.md).")
        if replicas < 1 or not 0 <= replica_id < replicas:
            raise ValueError(f"fault_tolerance: replica_id={replica_id} must lie in [0, replicas={replicas}).")
        if self.min_replicas > replicas:
            raise ValueError(f"fault_tolerance.min_replicas={self.min_replicas} exceeds replicas={replicas}: no "
                             f"quorum could ever form; lower min_replicas.")
        return replace(self, replicas=replicas, replica_id=replica_id, lighthouse=lighthouse)


def _env_int(env: Mapping[str, str], name: str, field: str) -> int:
    raw = env.get(name)
    if raw is None:
        raise ValueError(f"fault_tolerance.{field} is not set and ${name} is not in the environment: set one "
                         f"(lp-train sets ${name} for the replica groups it starts).")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} must be an integer.") from None
