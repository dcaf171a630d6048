"""The import layers of ringcomm/ hold, and an import that climbs a layer breaks them.

The contracts live in pyproject.toml ([tool.importlinter]); `make test` runs `lint-imports`
itself. These tests also show the contracts can fail: a copy of the package with one climbing
import added must be refused.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache", "--config", str(root / "pyproject.toml")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_layers_hold():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


@pytest.mark.parametrize(("module", "statement"), [
    ("ringcomm/algorithms/ring.py", "from ringcomm.comm import base"),  # algorithm -> Communicator
    ("ringcomm/codecs/int8.py", "from ringcomm.algorithms import ring"),  # codec -> algorithm
    ("ringcomm/ops/numpy.py", "import ringcomm.codecs.feedback"),  # ops -> codecs
    ("ringcomm/core/types.py", "import ringcomm.ops"),  # the bottom imports nothing
    ("ringcomm/comm/agree.py", "import ringcomm.backends.mpi"),  # Communicator -> a backend
    ("ringcomm/backends/gloo.py", "import ringcomm"),  # backend -> the package root
])
def test_a_climbing_import_is_refused(tmp_path, module, statement):
    shutil.copytree(ROOT / "ringcomm", tmp_path / "ringcomm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{statement}  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0, result.stdout
    assert "BROKEN" in result.stdout
    assert module[:-3].replace("/", ".") in result.stdout


def _layered(layers: list[str], module: str) -> bool:
    """Whether ``module`` is in one of the layers (named, or inside a named package)."""
    names = {name.strip() for layer in layers for name in layer.split(":")}
    return any(module == n or module.startswith(n + ".") for n in names)


def test_every_module_is_in_a_layer():
    """A new module is in no layer until pyproject.toml names it, and then nothing checks its
    imports: every module of ringcomm/ must be named (or sit in a named package). The package
    roots are covered by the contract that forbids importing them from below."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c["layers"] for c in config["contracts"] if c["type"] == "layers")
    roots = {"ringcomm", "ringcomm.comm", "ringcomm.compress", "ringcomm.torch"}
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for p in (ROOT / "ringcomm").rglob("*.py")}
    assert len(modules) > 60
    missing = sorted(m for m in modules - roots if not _layered(layers, m))
    assert missing == [], f"modules in no layer of pyproject.toml: {missing}"


def _cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle_anywhere():
    """No module imports (at the top or inside a function) one that imports it back, directly
    or through others: within a layer too, where the layer contract allows both directions."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("ringcomm")
    assert _cycles(graph) == []
    graph.add_import(importer="ringcomm.torch.horovod._basics",
                     imported="ringcomm.torch.horovod.timeline")
    assert ["ringcomm.torch.horovod._basics", "ringcomm.torch.horovod.timeline"] in _cycles(graph)
