"""Where each rank is in a run (step and phase), kept in the run's TCPStore, so that a rank whose collective timed
out can say which ranks never arrived and where they were last seen.

gloo's own error says only "Timed out waiting 5000ms for recv operation". torch 2.13's flight recorder
(``TORCH_FR_BUFFER_SIZE``) does record gloo collectives, but in each process's own memory: gloo has no watchdog that
makes every rank dump it on a timeout, so the rank that timed out cannot read the stuck rank's entries (checked:
``_dump_fr_trace()`` on the waiting rank lists its own two all-reduces, both "scheduled"). So each rank writes its
own place -- a few dozen bytes, one ``set`` on the rendezvous store per phase -- and the rank that timed out reads
everyone's, over a connection of its own that no blocked collective holds.

The phases, in the order a step passes them (validation and checkpoint saves after step ``s - 1`` count as the
start of step ``s``, the value ``global_step`` has then): :data:`PHASES`.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta
from typing import Any, Optional

PHASES = ("validation", "checkpoint save", "training_step", "backward", "optimizer_step")
SETUP, FINISHED = "setup", "finished"  # before step 0; after the last step
_PREFIX = "lightning_parallel/rank_record/"
_state: dict[str, "RankRecord"] = {}


def _position(entry: dict[str, Any]) -> tuple[float, int]:
    """Sortable place of a record: (step, phase order); setup first, finished last."""
    if entry["phase"] == SETUP:
        return (-1.0, 0)
    if entry["phase"] == FINISHED:
        return (float("inf"), 0)
    return (float(entry["step"]), PHASES.index(entry["phase"]))


def _where(entry: dict[str, Any]) -> str:
    return entry["phase"] if entry["phase"] in (SETUP, FINISHED) else f"{entry['phase']} of step {entry['step']}"


class RankRecord:
    """This rank's place in the run, published in a store, and the other ranks' places read back.

    Args:
        store: a ``torch.distributed.Store`` every rank reaches (the rendezvous TCPStore).
        rank: this process's global rank.
        world_size: how many ranks publish.
    """

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.own: Optional[dict[str, Any]] = None

    @classmethod
    def connect(cls, rank: int, world_size: int, timeout_s: float = 3.0) -> Optional["RankRecord"]:
        """A record on the run's rendezvous store (``MASTER_ADDR``/``MASTER_PORT``), or None where there is none.

        Args:
            rank: this process's global rank.
            world_size: how many ranks publish.
            timeout_s: how long one store operation may wait (a store whose host died fails after it).
        """
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if world_size < 2 or not addr or not port:
            return None
        import torch.distributed as dist

        store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        return cls(store, rank, world_size)

    def enter(self, phase: str, step: int) -> None:
        """Publish that this rank entered ``phase`` of ``step`` now."""
        if phase not in PHASES + (SETUP, FINISHED):
            raise ValueError(f"Unknown phase {phase!r}: choose one of {PHASES + (SETUP, FINISHED)}.")
        self.own = {"phase": phase, "step": int(step), "t": time.time(), "timed_out": False, "pid": os.getpid(),
                    "host": socket.gethostname()}
        self.store.set(_PREFIX + str(self.rank), json.dumps(self.own))

    def read(self) -> dict[int, Optional[dict[str, Any]]]:
        """Every rank's last record (None for a rank that never wrote one)."""
        keys = {rank: _PREFIX + str(rank) for rank in range(self.world_size)}
        found = {rank: key for rank, key in keys.items() if self.store.check([key])}
        return {rank: json.loads(self.store.get(found[rank])) if rank in found else None for rank in keys}

    def where_others_were(self, settle_s: float = 1.0) -> str:
        """After this rank's collective timed out: which ranks never arrived where this one waits, and where they
        were last seen; never raises (a store that is gone is said so).

        Args:
            settle_s: at most this long, wait for the ranks that wait too to mark their own timeouts, so that a
                rank stuck inside the same phase is told from the ones waiting for it.
        """
        if self.own is None:
            return "Where the ranks were: this rank recorded no phase yet."
        try:
            self.own = {**self.own, "timed_out": True}
            self.store.set(_PREFIX + str(self.rank), json.dumps(self.own))
            records = self._settled(settle_s)
        except Exception as error:  # noqa: BLE001 - the store's host (rank 0's process) may be the one lost
            return f"Where the ranks were: unknown, the run's store did not answer ({error}); its host may be lost."
        return describe(records, self.rank, time.time())

    def _settled(self, settle_s: float) -> dict[int, Optional[dict[str, Any]]]:
        deadline = time.monotonic() + settle_s
        while True:
            records = self.read()
            waiting = [r for r, e in records.items() if e is not None and e["timed_out"]]
            if len(waiting) == self.world_size or time.monotonic() >= deadline:
                return records
            time.sleep(0.1)


def _gone(entry: dict[str, Any]) -> str:
    """" (process N is gone)" for a rank on this host whose process no longer exists, else ""."""
    if entry.get("host") != socket.gethostname() or not entry.get("pid"):
        return ""
    try:
        os.kill(int(entry["pid"]), 0)
    except ProcessLookupError:
        return f" (process {entry['pid']} is gone)"
    except OSError:  # alive, owned by another user
        return ""
    return ""


def _about(other: int, entry: Optional[dict[str, Any]], own: dict[str, Any], now: float) -> tuple[str, str]:
    """``(kind, sentence)`` for one other rank: kind ``behind``, ``stuck``, ``waited`` or ``ahead``."""
    if entry is None:
        return "behind", f"rank {other} never recorded a phase (still starting, or lost before setup)"
    gone, ago = _gone(entry), now - entry["t"]
    if _position(entry) < _position(own):
        verb = f"died{gone} before reaching" if gone else "never reached"
        return "behind", f"rank {other} {verb} {_where(own)} (last seen: {_where(entry)}, {ago:.1f} s ago)"
    if entry["timed_out"]:
        return "waited", ""
    if _position(entry) == _position(own):
        if gone:
            return "stuck", f"rank {other} died{gone} in {_where(entry)} (entered {ago:.1f} s ago)"
        return "stuck", (f"rank {other} is in {_where(entry)} too but did not time out: stuck inside it "
                         f"(entered {ago:.1f} s ago)")
    return "ahead", ""


def describe(records: dict[int, Optional[dict[str, Any]]], rank: int, now: float) -> str:
    """The sentence naming the ranks behind ``rank``'s record, from every rank's record.

    Args:
        records: rank -> its last record (None: never wrote one).
        rank: the rank whose collective timed out (its record is where the others should have arrived).
        now: the wall-clock time to measure "ago" from.
    """
    own = records[rank]
    found: dict[str, list] = {"behind": [], "stuck": [], "waited": [], "ahead": []}
    for other, entry in sorted(records.items()):
        if other != rank:
            kind, sentence = _about(other, entry, own, now)
            found[kind].append(sentence if kind in ("behind", "stuck") else other)
    if not found["behind"] and not found["stuck"]:
        return (f"Where the ranks were: every rank reached {_where(own)}; none is behind (a collective that differs "
                f"between ranks, or a broken connection, rather than a lost rank).")
    waited = found["waited"]
    also = f"; ranks {', '.join(map(str, [rank, *waited]))} timed out waiting there" if waited else ""
    return "Where the ranks were: " + "; ".join(found["behind"] + found["stuck"]) + also + "."


def install(record: Optional[RankRecord]) -> None:
    """Make ``record`` this process's (None: remove it)."""
    if record is None:
        _state.pop("record", None)
    else:
        _state["record"] = record


def current() -> Optional[RankRecord]:
    """This process's :class:`RankRecord` (None unless a :class:`~lightning_parallel.callbacks.RankRecorder` runs)."""
    return _state.get("record")
