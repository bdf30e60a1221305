"""Pipeline parallelism on ``torch.distributed.pipelining``: split a module, build a schedule, run steps.

What torch provides and is used as is: ``PipelineStage`` (send/recv, shape inference,
per-micro-batch backward) and the schedules (GPipe, 1F1B, interleaved, zero-bubble).
What it lacks is written here, one job per module (import from the module; this package
re-exports nothing):

* :mod:`.schedules` -- a choice of schedule by name, with the combinations torch refuses
  (or silently degrades) turned into early ``ValueError`` s;
* :mod:`.partition` -- cut points for the layers (uniform, by parameters, by measured time, explicit);
* :mod:`.stages` -- splitting a module into stages while keeping every parameter under its
  original name, so checkpoints load under any pipeline size (torchtitan's approach:
  unowned layers are replaced by an empty placeholder), with several tensors between
  stages and per-micro-batch side inputs;
* :mod:`.chain_check` -- the one-process check that the layer chain composes to ``forward``;
* :mod:`.tied` -- a parameter tied across stages (embedding and LM head) kept identical on
  the ranks holding it;
* :mod:`.runner` -- one call per training batch that returns the batch's loss on *every*
  pipeline rank, token-weighted when the loss comes as ``(sum, count)`` terms;
* :mod:`.timeline` -- a schedule's actions as a printable grid.
"""
