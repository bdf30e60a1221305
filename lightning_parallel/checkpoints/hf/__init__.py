"""Hugging Face ``save_pretrained`` folders: loaded into a parallelised module slice by slice (:mod:`.load`),
and written from a checkpoint (:mod:`.export`) using the ``hugging_face`` entry the model adapter saves
beside Lightning's state (``ModelAdapter.checkpoint_metadata``)."""
