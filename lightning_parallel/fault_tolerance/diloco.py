"""``fault_tolerance.mode=diloco`` and ``mode=streaming_diloco``: each replica group trains with its own (inner)
optimizer, and at a meeting the groups average their **pseudo-gradients** -- each group's drift since the last
meeting, ``last-meeting parameters - parameters now`` -- and an outer optimizer (Nesterov SGD by default) steps the
last-meeting parameters with that average; every group continues from the result (DiLoCo, Douillard et al. 2023).
Streaming DiLoCo (Douillard et al. 2025) splits the parameters into fragments that meet at staggered steps, each its
own outer step, so a meeting sends ``1 / fragments`` of the model; optionally in bf16.

Note:
    The algorithm is torchft's ``DiLoCo`` / ``_StreamingDiLoCoFragment`` (torchft/local_sgd.py): the same sign of
    the pseudo-gradient, the outer step taken from the last-meeting parameters, fragment ``i`` meeting at step
    ``(i + 1) * sync_every / fragments`` of every ``sync_every``, and their parameters and outer optimizer state
    sent to a recovering group. It is written here rather than wrapping that class because:

    * the meeting is driven by the suite's step (``ReplicaGroups.after_step``, the committed step count a rejoining
      group takes over with the loop state), not by a counter of optimizer-step hooks that a restarted group would
      start again at 0, out of step with the others' meetings;
    * a group healed at a meeting takes part in its average without counting (a sum with a count beside it, as
      ``mode=local_sgd``): under torchft's synchronous quorum a healed group counts, so its pseudo-gradient -- a
      copy of its donor's -- would weigh the donor twice;
    * the suite's parameters are DTensors (tensor parallel, ZeRO) or a pipeline stage's share: the outer
      optimizer here holds plain local tensors (every rank of a group its own shard, the same shard at the same
      rank of every group), so its state travels and loads without rebuilding DTensors;
    * a meeting that does not commit keeps every group's parameters (as ``mode=local_sgd``) and the last-meeting
      ones, so the next meeting's pseudo-gradient spans both periods; torchft resets the parameters to the
      last-meeting ones, dropping the period's training;
    * torchft quantises only on CUDA with Triton; ``exchange=bf16`` here casts the flat buffer (any device).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from lightning_parallel.fault_tolerance.flat_buffers import flatten_by_dtype, pieces
from lightning_parallel.fault_tolerance.options import FaultTolerance
from lightning_parallel.fault_tolerance.replica_state import local

STATE_KEY = "diloco"  # the entry of torchft's recovery state this module owns (beside the suite's "default")
_EXCHANGE = {"fp32": None, "bf16": torch.bfloat16}


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """This rank's trainable parameters in module order (the same order at the same rank of every group)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad and local(p).device.type != "meta"]


def split_fragments(sizes: list[int], count: int) -> list[list[int]]:
    """Indices of ``sizes`` in ``count`` contiguous runs of about equal total size (a run may be empty).

    Args:
        sizes: element counts, in order.
        count: fragments.
    """
    total, start, out = max(sum(sizes), 1), 0, [[] for _ in range(count)]
    for i, size in enumerate(sizes):
        out[min(count - 1, int(count * (start + size / 2) / total))].append(i)  # by the tensor's middle
        start += size
    return out


class OuterSync:
    """DiLoCo's outer loop on one rank: last-meeting parameters, the outer optimizer, fragments and their meetings.

    Args:
        named_params: :func:`trainable` of the module (this rank's share; DTensors stay the module's).
        options: ``strategy.fault_tolerance`` (mode, ``sync_every``, ``fragments``, outer optimizer, exchange).
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], options: FaultTolerance) -> None:
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        # The global parameters as of the last meeting (at start: the first quorum's, see ReplicaGroups.open), kept
        # beside the parameters on their device; torchft keeps them in pinned CPU memory instead.
        self.originals = [local(p.data).detach().clone() for p in self.params]
        self.device = self.originals[0].device if self.originals else torch.device("cpu")
        count = options.fragments if options.mode == "streaming_diloco" else 1
        self.fragments = split_fragments([t.numel() for t in self.originals], count)
        self.interval = options.sync_every // count
        self.outer = torch.optim.SGD(self.originals, lr=options.outer_lr, momentum=options.outer_momentum,
                                     nesterov=options.outer_nesterov)
        self.exchange = _EXCHANGE[options.exchange]
        self.delay, self.mix = options.sync_delay, float(options.fragment_mix)
        self._pending: Optional[tuple] = None  # an exchange in flight: start() to finish()
        self.meetings: list[dict[str, Any]] = []  # step, started, fragment, bytes sent, committed: what tests count

    def fragment_at(self, step: int) -> Optional[int]:
        """The fragment that meets after ``step`` committed steps, or None between meetings.

        Args:
            step: steps taken, this one included (fragment ``i`` meets at ``(i + 1) * interval`` of each cycle).
        """
        if step < 1 or step % self.interval:
            return None
        return (step // self.interval - 1) % len(self.fragments)

    def fragment_names(self) -> list[list[str]]:
        """Each fragment's parameter names (the module's)."""
        return [[self.names[i] for i in fragment] for fragment in self.fragments]

    def register(self, manager: Any) -> None:
        """Send the last-meeting parameters and outer optimizer state with torchft's recovery state.

        Args:
            manager: the rank's torchft manager, before its first quorum.
        """
        manager.register_state_dict_fn(STATE_KEY, self.load_state_dict, self.state_dict)

    def state_dict(self) -> dict[str, Any]:
        """Last-meeting parameters (plain local tensors) and the outer optimizer's state."""
        return {"originals": [t.detach().clone() for t in self.originals], "outer": self.outer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a healthy group's :meth:`state_dict` (same layout, same rank)."""
        if len(state["originals"]) != len(self.originals):
            raise ValueError(f"DiLoCo recovery state holds {len(state['originals'])} tensors, this rank "
                             f"{len(self.originals)}: every replica group must run the same model and layout.")
        for mine, theirs in zip(self.originals, state["originals"]):
            mine.copy_(theirs)
        self.outer.load_state_dict(state["outer"])

    def starts_at(self, step: int) -> bool:
        """Whether a meeting's exchange starts after ``step`` steps (``sync_delay`` steps before its meeting)."""
        return self.fragment_at(step + self.delay) is not None

    @torch.no_grad()
    def start(self, manager: Any, step: int, contributes: bool) -> None:
        """Take the next meeting's pseudo-gradients and start their sum across groups (waited in :meth:`finish`).

        Args:
            manager: the torchft manager (this meeting's quorum taken).
            step: steps taken; the meeting is ``sync_delay`` steps later (:meth:`fragment_at` says which fragment).
            contributes: False for a group healed at this meeting's quorum (it sends zeros and is not counted).
        """
        from torch.distributed import ReduceOp

        fragment = self.fragment_at(step + self.delay)
        idx = self.fragments[fragment]
        drift = [self.originals[i] - local(self.params[i].data) for i in idx]  # torchft's sign: a gradient
        buffers = flatten_by_dtype(drift)
        sent = {dtype: flat if self.exchange is None or not flat.is_floating_point() else flat.to(self.exchange)
                for dtype, (_, flat) in buffers.items()}
        count = torch.tensor([1.0 if contributes else 0.0], device=self.device)
        works = [manager.allreduce(count, reduce_op=ReduceOp.SUM)]
        works += [manager.allreduce(buffer.zero_() if not contributes else buffer, reduce_op=ReduceOp.SUM)
                  for buffer in sent.values()]
        self._pending = (fragment, idx, drift, buffers, sent, count, works)
        self.meetings.append({"step": step + self.delay, "started": step, "fragment": fragment, "committed": False,
                              "bytes": sum(t.numel() * t.element_size() for t in (count, *sent.values()))})

    @torch.no_grad()
    def finish(self, manager: Any) -> bool:
        """The meeting: wait for the sum, vote, and step the fragment with the outer optimizer.

        Args:
            manager: the torchft manager.

        Returns:
            Whether the meeting committed; if not, every group keeps its parameters and the last-meeting ones.
        """
        fragment, idx, drift, buffers, sent, count, works = self._pending
        self._pending = None
        for work in works:
            work.wait()
        committed = bool(manager.should_commit()) and float(count) >= 1
        self.meetings[-1]["committed"] = committed
        if not committed:
            return False
        for dtype, (positions, flat) in buffers.items():
            mean = sent[dtype].to(flat.dtype) / count.to(flat.dtype)
            for j, piece in zip(positions, pieces(mean, [drift[k] for k in positions])):
                self.originals[idx[j]].grad = piece
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        for i in idx:  # every group continues from the new global parameters (mixed with its own, if asked)
            shard = local(self.params[i].data)
            shard.lerp_(self.originals[i], 1 - self.mix) if self.mix else shard.copy_(self.originals[i])
        return True

    @property
    def pending(self) -> bool:
        """Whether an exchange is in flight (started, its meeting not yet reached)."""
        return self._pending is not None
