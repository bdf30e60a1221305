"""Hugging Face ``save_pretrained`` folders: loaded into a parallelised module slice by slice (:mod:`.load`),
written from a checkpoint (:mod:`.export`), and the metadata the strategies save to make that possible
(:mod:`.metadata`)."""
