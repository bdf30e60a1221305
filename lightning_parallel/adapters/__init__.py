"""Model adapters: how a module that does not implement the suite's protocol is split.

A LightningModule's own protocol methods (:mod:`lightning_parallel.protocol`) always win;
an adapter answers only what the module leaves open. :mod:`.hf` understands Hugging Face
``transformers`` models held as a submodule (their ``tp_plan``, ``pp_plan``, config head
counts, tied weights, causal-LM loss). New model families are new adapters, not branches
in strategies.
"""
