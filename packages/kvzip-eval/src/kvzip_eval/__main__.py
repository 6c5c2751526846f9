"""``python -m kvzip_eval ...`` runs the ``kvzip`` command (e.g. where kvzip is on PYTHONPATH
but not installed)."""

from kvzip_eval.cli import main

if __name__ == "__main__":
    main()
