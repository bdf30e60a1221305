"""What the library and the ``lp-*`` commands both need at run time, with no dependency on either.

* :mod:`.ports` -- a free TCP port for a rendezvous (the test harness and ``lp-train``'s local launcher);
* :mod:`.config_dir` -- where the bundled Hydra configs are (inside the wheel, or ``conf/`` in a checkout);
* :mod:`.console` -- the two-column tables the strategies, callbacks and commands print, copied to the run's log;
* :mod:`.signals` -- the graceful-stop state a ``SIGINT``/``SIGTERM`` sets and the callbacks read.

The library never imports :mod:`lightning_parallel.cli`; what it used to borrow from there lives here.
"""
