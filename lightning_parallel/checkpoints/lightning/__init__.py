"""Lightning's own checkpoints: read into the suite's keys (:mod:`.reader`) and written as one file that
Lightning's own strategies resume (:mod:`.writer`)."""
