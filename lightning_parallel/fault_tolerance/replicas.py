"""The strategy's side of fault tolerance: one torchft manager per rank, a quorum per step, gradients averaged
across replica groups, a vote before every optimizer step, and a healthy peer's state for a group that rejoins.

A step under ``strategy.fault_tolerance`` (mode ``ddp``):

1. Before the first forward of the accumulation window: a quorum (synchronous). A group that is behind -- one
   that restarted -- receives the current parameters, optimizer and scheduler state, data position and training
   loop (:mod:`.loop_state`) from a healthy peer here (torchft's HTTP transport, no checkpoint read) and takes part
   in this very step.
2. After backward (and the expert and data-axis reductions inside the group): one all-reduce per gradient dtype
   across the groups of the quorum (torchft divides by the groups taking part), then the commit vote. A step that
   does not commit (a group died mid-step) leaves the parameters untouched on every group.
3. The optimizer step, with the learning rate scaled by ``lr_rule`` for the groups taking part.

Lightning's ``global_step`` counts committed steps, so ``max_steps`` means committed updates. Modes ``local_sgd``,
``diloco`` and ``streaming_diloco`` skip steps 1-3: the groups meet at the end of every few steps instead
(:meth:`ReplicaGroups.after_step`; :mod:`.local_sgd`, :mod:`.diloco`).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from functools import cached_property
from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer

from lightning_parallel.fault_tolerance import loop_state
from lightning_parallel.fault_tolerance.data_position import skip_batches
from lightning_parallel.fault_tolerance.diloco import OuterSync, trainable
from lightning_parallel.fault_tolerance.gradient_average import average_gradients
from lightning_parallel.fault_tolerance.lighthouse import check_reachable, require_torchft
from lightning_parallel.fault_tolerance.local_sgd import average_parameters
from lightning_parallel.fault_tolerance.options import DILOCO_MODES, FaultTolerance
from lightning_parallel.fault_tolerance.replica_state import state_functions
from lightning_parallel.runtime import signals
from lightning_parallel.scaling import lr_factor


class ReplicaGroups:
    """Fault tolerance across replica groups for one rank of one group (see the module docstring).

    Args:
        options: ``strategy.fault_tolerance`` (resolved from the environment at :meth:`open`).
    """

    def __init__(self, options: FaultTolerance) -> None:
        self.options = options
        self.manager: Any = None
        self.process_group: Any = None
        self._liveness_group: Any = None
        self.participants = 0
        self.failed_commits = 0
        self._need_quorum = True
        self._committed = True
        self.run_stop_agreed = False  # a run-wide stop voted at the last step (reduce_and_commit)
        self._position = {"epoch": 0, "batch": 0, "step": 0}
        self._loaders: Optional[dict[str, Any]] = None  # the loader position at the end of the last step
        self._local_sgd = options.mode != "ddp"  # local_sgd and the diloco modes: groups meet every few steps
        self.outer: Optional[OuterSync] = None  # the diloco modes' outer loop (opened with the manager)
        self._recovered: Optional[dict[str, Any]] = None
        self._skip_batches = 0
        self._trainer: Any = None
        self._module: Any = None
        self._recovered_now = False
        self._started = False
        self._planned_lr: Optional[tuple[Optimizer, list[float]]] = None

    @cached_property
    def resolved(self) -> FaultTolerance:
        """The options with replica group, group count and lighthouse filled from the environment (read once: the
        quorum, the learning-rate factor and every log line use it each step)."""
        return self.options.resolved()

    def sampler_kwargs(self, inner: dict[str, int]) -> dict[str, int]:
        """Lightning's ``distributed_sampler_kwargs`` across groups: group ``g`` reads shards ``g*d .. g*d+d-1``.

        Args:
            inner: the group's own ``{"num_replicas": d, "rank": r}`` (its data axis).
        """
        o = self.resolved
        return {"num_replicas": inner["num_replicas"] * o.replicas, "rank": o.replica_id * inner["num_replicas"]
                + inner["rank"]}

    # --- lifecycle -------------------------------------------------------------------------
    def open(self, strategy: Any, trainer: Any, optimizers: list[Optimizer]) -> None:
        """Start this rank's manager and take the first quorum, healing from a peer if this group is behind.

        Args:
            strategy: the strategy (its rank, world size, device and cluster environment: the group's own store).
            trainer: the Trainer (schedulers and loop counters).
            optimizers: the torch optimizers.
        """
        torchft = require_torchft()
        o = self.resolved
        check_reachable(o.lighthouse, o.connect_timeout)
        self._trainer = trainer
        timeout = timedelta(seconds=o.timeout)
        pg = torchft.ProcessGroupNCCL(timeout=timeout) if strategy.root_device.type == "cuda" else \
            torchft.ProcessGroupGloo(timeout=timeout)
        self.process_group = pg  # reconfigured by the manager at every quorum change
        state_dict, load_state_dict = state_functions(
            strategy.lightning_module, lambda: optimizers, lambda: [c.scheduler for c in trainer.lr_scheduler_configs],
            self._position_for_peer, self._on_recovered)
        if strategy.world_size > 1:  # gloo's monitored_barrier; its group's timeout bounds the wait for a hung rank 0
            liveness_timeout = timedelta(seconds=o.group_timeout)  # (monitored_barrier's own bounds only rank 0's wait)
            self._liveness_group = torch.distributed.new_group(backend="gloo", timeout=liveness_timeout)
        env = strategy.cluster_environment
        # Synchronous quorum: a group that heals takes part in the same step, so no batch is read in vain.
        self.manager = torchft.Manager(
            pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=o.min_replicas,
            use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=o.quorum_timeout),
            connect_timeout=timedelta(seconds=o.connect_timeout), rank=strategy.global_rank,
            world_size=strategy.world_size, store_addr=env.main_address, store_port=env.main_port,
            lighthouse_addr=o.lighthouse, replica_id=f"replica_{o.replica_id}", init_sync=True)
        if o.mode in DILOCO_MODES:  # before the first quorum: a group healing there receives the outer state too
            self.outer = OuterSync(trainable(strategy.lightning_module), o)
            self.outer.register(self.manager)
            if trainer.ckpt_path:  # never silently: checkpoints hold the model and inner optimizer only
                self._say(f"{o.mode}: checkpoints do not hold the outer momentum and last-meeting parameters; this "
                          "resume starts the outer loop afresh from the resumed parameters.")
        self._quorum()  # the first step's quorum, before the training loader exists (see process_dataloader)
        if self._local_sgd and self._recovered_now and trainer.global_step > 0:
            # healed at the others' meeting: join its average, uncounted
            self._sync_parameters(contributes=False, step=int(trainer.global_step))
        elif self._local_sgd:
            # A fresh start commits its quorum at once: the manager's step then counts meetings from 1, so the
            # first meeting does not take every group for a new one (torchft heals every group at step 0).
            # The commit closes this group's checkpoint server, and nothing else in a local step waits for the
            # groups healing from it: a collective they join only once healed keeps it open until they hold it.
            self.manager.allreduce(torch.zeros(1, device=strategy.root_device)).wait()
            self.manager.should_commit()

    def close(self) -> None:
        """Stop the manager (its server and checkpoint transport)."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None

    # --- per step ---------------------------------------------------------------------------
    def before_forward(self, batch_idx: int) -> None:
        """The window's quorum (once per optimizer step) and the data position a healing peer would take."""
        if self._trainer is None:
            return
        self._started = True
        self._position = {"epoch": int(self._trainer.current_epoch), "batch": int(batch_idx),
                          "step": int(self._trainer.global_step)}
        if self._need_quorum and not self._local_sgd:
            self._quorum()

    def reduce_and_commit(self, module: nn.Module, optimizer: Optimizer) -> bool:
        """Average gradients across the quorum's groups, vote, and set the learning rate for the groups taking
        part; a step that does not commit drops the gradients (the optimizer then changes nothing).

        Args:
            module: the trained module (this rank's share).
            optimizer: the torch optimizer about to step (:meth:`after_step` restores its planned learning rate).
        """
        self._module = module
        if self._local_sgd:  # each group steps on its own gradient; parameters meet every sync_every steps
            return True
        params = [p for p in module.parameters() if p.requires_grad]
        # A run-wide stop (the supervisor stopped) is voted with the gradients: every group of the quorum learns it
        # at the same step and stops after it (callbacks/graceful_stop.py), with the same committed parameters.
        stop = average_gradients(self.manager, params, (1.0 if signals.run_wide_stop() else 0.0,))
        self.run_stop_agreed = stop[0] > 0
        self._committed = bool(self.manager.should_commit())
        if not self._committed:
            self.failed_commits += 1
            for p in params:  # optimizers skip parameters without a gradient: the step changes nothing
                p.grad = None
            self._say(f"step {self.manager.current_step()} did not commit (a replica group failed during it); "
                      f"the parameters are unchanged and the next step forms a new quorum")
        # After the quorum of this step (the closure's forward took it): its size sets the factor.
        factor = lr_factor(self.options.lr_rule, max(self.participants, 1), self.resolved.replicas)
        self._planned_lr = (optimizer, [group["lr"] for group in optimizer.param_groups])
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        return self._committed

    @property
    def last_committed(self) -> bool:
        """Whether the last optimizer step committed (its update was applied on every group of its quorum)."""
        return self._committed

    def after_step(self) -> None:
        """Restore the planned learning rate (LR schedulers and checkpoints see it), note where the training loader
        stands (a group healing at the next quorum continues from there) and make Lightning's step counter follow
        the committed steps (it adds one after this returns)."""
        if self._planned_lr is not None:
            optimizer, planned = self._planned_lr
            for group, lr in zip(optimizer.param_groups, planned):
                group["lr"] = lr
            self._planned_lr = None
        self._need_quorum = True
        self._loaders = loop_state.loader_position(self._trainer)  # before the next batch is drawn
        if self._local_sgd:
            self._after_local_step()
            return
        loop_state.set_global_step(self._trainer, self.manager.current_step() - 1, counting=True)

    def _after_local_step(self) -> None:
        """``local_sgd`` and the diloco modes: at a meeting step a quorum and the parameter average or the meeting
        fragment's outer step (a restarted group that waits at start-up joins here). The position a healing group
        takes is the next step's."""
        trainer = self._trainer
        step = int(trainer.global_step) + 1  # Lightning counts this step after we return
        if self.outer is not None and self.outer.pending and self.outer.fragment_at(step) is not None:
            self._note_commit(self.outer.finish(self.manager), step)  # an overlapped exchange lands (sync_delay)
        if (step % self.options.sync_every if self.outer is None else not self.outer.starts_at(step)):
            return
        last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch  # the next batch opens the next epoch
        epoch, batch = int(trainer.current_epoch), self._position["batch"] + 1
        self._position = {"epoch": epoch + 1 if last else epoch, "batch": 0 if last else batch, "step": step}
        self._quorum()
        # A group healed at this quorum (it had fallen behind) holds a copy of its donor's: counting it would weigh
        # the donor twice.
        self._sync_parameters(contributes=not self._recovered_now, step=step)

    def _sync_parameters(self, contributes: bool, step: int) -> None:
        if self.outer is not None:  # diloco: the exchange starts; the outer step lands now or sync_delay steps later
            self.outer.start(self.manager, step, contributes)
            if not self.options.sync_delay:
                self._note_commit(self.outer.finish(self.manager), step)
            return
        module = self._module if self._module is not None else self._trainer.lightning_module
        params = [p for p in module.parameters() if p.requires_grad]
        self._note_commit(average_parameters(self.manager, params, contributes), step)

    def _note_commit(self, committed: bool, step: int) -> None:
        self._committed = committed
        if not committed:
            self.failed_commits += 1
            self._say(f"the meeting at step {step} did not commit; every group keeps its own parameters until the "
                      f"next one")

    # --- data ------------------------------------------------------------------------------
    def position_loader(self, loader: Any) -> Any:
        """Start the training loader where the healthy groups are (after a heal at start-up)."""
        if self._skip_batches:
            notice = skip_batches(loader, self._skip_batches)
            self._say(notice or f"training data resumes at batch {self._skip_batches} of epoch "
                      f"{self._trainer.current_epoch} of this group's shard")
            self._skip_batches = 0
        return loader

    # --- internals -------------------------------------------------------------------------
    def _quorum(self) -> None:
        o, started = self.resolved, time.perf_counter()
        self._check_group_alive()
        try:
            self.manager.start_quorum()
        except TimeoutError as error:
            raise RuntimeError(
                f"fault_tolerance: no quorum of {o.min_replicas} replica group(s) formed within {o.quorum_timeout:g} s "
                f"(lighthouse {o.lighthouse}). Start the other groups, or lower fault_tolerance.min_replicas / the "
                f"lighthouse's --min_replicas; if all run, a hung group of one process (no peer stops it after "
                f"group_timeout) still heartbeats and holds the quorum back: restart it.") from error
        self._need_quorum = False
        participants = self.manager.num_participants()
        if not self._started and self.manager.current_step() == 0 and participants < o.replicas:
            participants = self._wait_for_all_groups(participants)
        self._recovered_now = self._recovered is not None
        if self._recovered is not None:
            self._heal_loop_state(self._recovered, time.perf_counter() - started)
            self._recovered = None
        if participants != self.participants:
            self._say(self._quorum_line(participants))
            self.participants = participants

    def _quorum_line(self, participants: int) -> str:
        o, meetings = self.resolved, self.manager.current_step()
        if self._local_sgd:
            what = "parameters averaged" if self.outer is None else f"{o.mode}: pseudo-gradients averaged, outer step"
            return (f"quorum of {participants}/{o.replicas} replica groups at meeting {meetings} (step "
                    f"{self._position['step']}): {what} over the groups taking part every {o.sync_every} steps")
        factor = lr_factor(o.lr_rule, max(participants, 1), o.replicas)
        skipped = meetings * o.replicas - self.manager.batches_committed()
        return (f"quorum of {participants}/{o.replicas} replica groups at step {meetings}: global batch "
                f"x{participants / o.replicas:g}, learning rate x{factor:.4g} ({o.lr_rule}); replica-batches not "
                f"trained so far: {max(skipped, 0)}")

    def _check_group_alive(self) -> None:
        """Every rank of this group reached the step boundary within ``group_timeout``, or this rank fails (and the
        group is restarted): see ``FaultTolerance.group_timeout`` for why a hung rank must not wait longer."""
        if self._liveness_group is None:
            return
        timeout = timedelta(seconds=self.resolved.group_timeout)
        try:
            torch.distributed.monitored_barrier(group=self._liveness_group, timeout=timeout)
        except RuntimeError as error:
            raise RuntimeError(f"fault_tolerance: a rank of replica group {self.resolved.replica_id} did not reach "
                               f"step {self.manager.current_step()} within group_timeout={timeout.total_seconds():g} "
                               f"s ({error}); this group stops so the others can go on without it.") from error

    def _wait_for_all_groups(self, participants: int) -> int:
        """A fresh start waits (``startup_wait``) for every group, so step 0 is not taken by whichever group
        reached the lighthouse first. The number of tries, not the clock, ends the wait: every rank of a group
        sees the same quorums, so all of them stop at the same one."""
        o = self.resolved
        for _ in range(int(o.startup_wait / 0.25)):
            if participants >= o.replicas:
                break
            time.sleep(0.25)
            self.manager.start_quorum()
            participants = self.manager.num_participants()
        if participants < o.replicas:
            self._say(f"starting with {participants}/{o.replicas} replica groups after waiting {o.startup_wait:g} s "
                      f"for the others (fault_tolerance.startup_wait); they join when they come")
        return participants

    def _position_for_peer(self) -> dict[str, Any]:
        """What a healing peer receives besides the weights (torchft's quorum thread calls it while this rank's
        main thread waits for the quorum): the data position and this group's fit loop (:mod:`.loop_state`)."""
        loop = None
        if self._trainer is not None and self._started:
            loop = loop_state.resume_state(self._trainer, batch_done=self._local_sgd, loaders=self._loaders)
        return {**self._position, "loop": loop}

    def _on_recovered(self, position: dict[str, Any]) -> None:
        self._recovered = dict(position)  # applied by _quorum on the main thread, after the state is loaded

    def _heal_loop_state(self, position: dict[str, Any], seconds: float) -> None:
        trainer, step = self._trainer, int(position.get("step", self.manager.current_step()))
        if self._started:  # a group that fell behind mid-run: its loop and loader ran the same batches; go on
            # local_sgd heals inside a step's end, before Lightning counts that step
            loop_state.set_global_step(trainer, step - 1 if self._local_sgd else step, counting=self._local_sgd)
            where = "this group's data position continues"
        else:  # before the fit loop runs: the loop continues the sender's counters, the loader where it is
            loop = position.get("loop")
            positioned = loop is not None and loop_state.restore(trainer, loop)
            loop_state.set_global_step(trainer, step)
            epoch, batch = loop_state.next_batch(loop) if loop is not None else (0, 0)
            self._skip_batches = 0 if positioned else batch
            where = f"data from epoch {epoch}, batch {batch}"
        self._say(f"recovered step {step} from a healthy replica group in {seconds:.2f} s ({where})")

    def _say(self, message: str) -> None:
        rank_zero_info(f"lightning_parallel: [replica group {self.resolved.replica_id}] {message}")


def ft_environment(replica_id: int, replicas: int, lighthouse: str) -> dict[str, str]:
    """The environment a replica group's processes need (what lp-train and the test harness set)."""
    return {"REPLICA_GROUP_ID": str(replica_id), "NUM_REPLICA_GROUPS": str(replicas), "TORCHFT_LIGHTHOUSE": lighthouse,
            "TORCHFT_QUORUM_RETRIES": os.environ.get("TORCHFT_QUORUM_RETRIES", "0")}
