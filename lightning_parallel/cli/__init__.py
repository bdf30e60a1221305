"""The commands and the run machinery: ``lp-train``, ``lp-compare``, ``lp-plan``, ``lp-convert``.

The application around the library: composing Hydra configs, checking them before any process
starts (:mod:`.preflight`), rescaling hyperparameters, launching local ranks (:mod:`.launch`),
run folders and resume (:mod:`.run_folder`, :mod:`.run_resume`, :mod:`.run_start`), the start-up
and result tables (:mod:`.report`), sweep summaries (:mod:`.sweep_summary`) and
``strategy=planned`` (:mod:`.planned`). The library never imports this package; what both need
lives in :mod:`lightning_parallel.runtime`.
"""
