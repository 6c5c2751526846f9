"""The ``kvzip`` command: a click group whose subcommands load lazily.

Each subcommand lives in its own module (``cmd_<name>.py``) exposing a click command named
``command``, so ``kvzip --help`` stays fast and a subcommand's heavy imports (transformers,
vLLM) happen only when it runs. Every command prints a table and takes the same output
options (``options.output_options``): ``--json PATH|-`` and ``--report DIR``.
"""

from __future__ import annotations

import importlib

import click

from kvzip_eval._version import __version__

SUBCOMMANDS = {
    "capacity": ("kvzip_eval.cmd_capacity", "Concurrent 131k-token sessions per GPU, per format."),
    "eval": ("kvzip_eval.cmd_eval", "Quality of every format: KL, words changed, retrieval."),
    "calibrate": ("kvzip_eval.cmd_calibrate", "One-time calibration of the compact formats."),
    "lossless": ("kvzip_eval.cmd_lossless", "Bit-exact codec ratio on a model's real KV cache."),
    "report": ("kvzip_eval.cmd_report", "Rebuild the report of a saved --json result."),
    "bench": ("kvzip_eval.cmd_bench", "Measure on this machine: serving, the tier, the kernels."),
    "model": ("kvzip_eval.cmd_model", "The embedded model's local folder (for `vllm serve`)."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(SUBCOMMANDS)

    def get_command(self, ctx, name):
        if name not in SUBCOMMANDS:
            return None
        module = importlib.import_module(SUBCOMMANDS[name][0])
        return module.command

    def format_commands(self, ctx, formatter):
        rows = [(name, help_) for name, (_, help_) in SUBCOMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup)
@click.version_option(__version__, prog_name="kvzip")
def main() -> None:
    """kvzip: KV-cache compression for LLM serving (lossless tier, compact formats, evaluation)."""


if __name__ == "__main__":
    main()
