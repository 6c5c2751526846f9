"""``kvzip bench``: the serving, tier and kernel measurements (``kvzip_eval.cmd_bench``), their
engines' set-up (:mod:`~kvzip_eval.bench.engines`), arithmetic and result files."""
