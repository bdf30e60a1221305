"""DeepSpeed checkpoint folders: where their files are and their weights (:mod:`.folder`), their optimizer
state per parameter name (:mod:`.optimizer`), and their conversion to a plain file or the suite's DCP folder
(:mod:`.convert`)."""
