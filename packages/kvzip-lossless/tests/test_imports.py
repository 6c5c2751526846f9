"""The package's modules import one another without a cycle (a cycle is what forces lazy
imports inside functions and breaks a module imported on its own)."""

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PKG = Path(__file__).parents[1] / "src" / "kvzip_lossless"
NAME = "kvzip_lossless"


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """Module -> package modules it imports, at any depth in its code (lazy imports inside
    functions count: they are cycles postponed). ``from kvzip_lossless import x`` names the
    module ``x`` if there is one, else the package's ``__init__``."""
    mods = {p.stem for p in pkg.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for m in mods:
        deps: set[str] = set()
        for node in ast.walk(ast.parse((pkg / f"{m}.py").read_text())):
            if isinstance(node, ast.Import):
                for a in node.names:
                    parts = a.name.split(".")
                    if parts[0] == NAME:
                        deps.add(parts[1] if len(parts) > 1 else "__init__")
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x / from .x import y
                    base = f"{NAME}.{base}" if base else NAME
                parts = base.split(".")
                if parts[0] != NAME:
                    continue
                if len(parts) > 1:
                    deps.add(parts[1])
                else:
                    deps |= {a.name if a.name in mods else "__init__" for a in node.names}
        deps.discard(m)
        graph[m] = deps
    return graph


def test_import_graph_is_acyclic():
    g = import_graph()
    assert {"codec", "gpu", "_cuda", "tiles", "checksum", "_torch"} <= set(g)
    try:
        order = list(TopologicalSorter(g).static_order())
    except CycleError as e:
        pytest.fail(f"import cycle among kvzip_lossless modules: {' -> '.join(e.args[1])}")
    assert order.index("checksum") < order.index("codec")
    for m, deps in g.items():
        if m != "__init__":
            assert "__init__" not in deps, f"{m} imports the package itself"


def test_cycle_detector_sees_a_lazy_cycle(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from kvzip_lossless import b\n")
    (tmp_path / "b.py").write_text("from kvzip_lossless.a import f\n")
    with pytest.raises(CycleError):
        list(TopologicalSorter(import_graph(tmp_path)).static_order())


def test_every_module_imports_first_in_a_fresh_interpreter():
    """Each module imported on its own, the package's modules cleared from ``sys.modules``
    before each (one interpreter for all: one per module would pay a torch import each)."""
    mods = sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")
    code = (
        "import sys, importlib\n"
        "keep = set(sys.modules)\n"
        f"for m in {mods!r}:\n"
        "    for k in [k for k in sys.modules if k.startswith('kvzip_lossless')]:\n"
        "        del sys.modules[k]\n"
        "    importlib.import_module('kvzip_lossless.' + m)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_cpu_package_needs_no_triton_and_no_vllm():
    """What ``pip install kvzip-lossless`` gives a CPU machine: compress/decompress with the
    compiled CPU coder while ``triton`` and ``vllm`` cannot be imported."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('triton', 'vllm'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, kvzip_lossless as kl\n"
        "x = (torch.randn(200, 2, 16) * 3).bfloat16()\n"
        "assert torch.equal(kl.decompress(kl.compress(x)).view(torch.int16), x.view(torch.int16))\n"
        "assert 'triton' not in sys.modules and 'vllm' not in sys.modules\n"
        "print(kl.coder('cpu'))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == "numba"
