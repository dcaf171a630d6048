"""torch.distributed as the oldest supported PyTorch has it, and the calls ringcomm makes into it.

The signatures are read from PyTorch's own source (``torch/distributed/distributed_c10d.py`` and
``torch/distributed/__init__.py`` of a wheel), not from an installed torch, so that the test
suite can hold a call against a version it does not run. Recorded once per supported minimum:

    python tests/torch_api.py record torch-2.4.0-cp311-none-macosx_11_0_arm64.whl \
        > tests/data/torch_distributed_2.4.json

(any wheel of that version will do: only its Python sources are read).
"""

from __future__ import annotations

import ast
import json
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

C10D = "torch/distributed/distributed_c10d.py"
INIT = "torch/distributed/__init__.py"
VERSION = "torch/version.py"


# ----------------------------------------------------------------------------- recording
def _defined_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _imported_names(tree: ast.AST) -> set[str]:
    """Every name an import statement anywhere in ``tree`` binds (``__init__`` imports most of
    torch.distributed's public names inside ``if is_available():``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names if a.name != "*")
    return names


def _signatures(tree: ast.Module) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            a = node.args
            out[node.name] = {
                "params": [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)],
                "var_keyword": a.kwarg is not None,
            }
    return out


def record(wheel: Path) -> dict[str, Any]:
    """The names and function signatures of torch.distributed in ``wheel``."""
    with zipfile.ZipFile(wheel) as z:
        c10d = ast.parse(z.read(C10D).decode())
        init = ast.parse(z.read(INIT).decode())
        version_src = z.read(VERSION).decode()
        # Submodules are attributes too (dist.distributed_c10d), once imported.
        submodules = {n[len("torch/distributed/"):].split("/")[0].removesuffix(".py")
                      for n in z.namelist() if n.startswith("torch/distributed/")}
    version = next(line.split("=", 1)[1].strip().strip("'\"") for line in version_src.splitlines()
                   if line.startswith("__version__"))
    names = (_defined_names(c10d) | _imported_names(c10d) | _defined_names(init)
             | _imported_names(init) | submodules)
    return {"torch": version, "source": Path(wheel).name, "names": sorted(names),
            "functions": _signatures(c10d)}


# ----------------------------------------------------------------------------- checking
@dataclass(frozen=True)
class Use:
    """One use of torch.distributed in a source file."""

    path: str
    line: int
    name: str                 # the attribute of torch.distributed
    keywords: tuple[str, ...]  # keyword arguments it is called with (empty: not a call)


def _is_dist(node: ast.AST, aliases: set[str]) -> bool:
    """``node`` is torch.distributed: an alias of it, or ``torch.distributed`` spelled out."""
    if isinstance(node, ast.Name):
        return node.id in aliases
    return (isinstance(node, ast.Attribute) and node.attr == "distributed"
            and isinstance(node.value, ast.Name) and node.value.id == "torch")


def _aliases(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.asname for a in node.names
                         if a.name == "torch.distributed" and a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            found.update(a.asname or a.name for a in node.names if a.name == "distributed")
    return found


def _keywords(call: ast.Call) -> tuple[str, ...]:
    return tuple(k.arg for k in call.keywords if k.arg is not None)


def uses(path: Path, source: str | None = None) -> list[Use]:
    """Every ``dist.X`` in the file, with the keywords of the call when it is one.

    A call through a wrapper that takes the function and its arguments (``bounded(what, peer,
    dist.X, *args, **kwargs)``, as the gloo transport runs each collective) counts as a call of
    ``dist.X`` with those keywords.
    """
    tree = ast.parse(source if source is not None else path.read_text())
    aliases = _aliases(tree)
    called: dict[int, tuple[str, ...]] = {}  # id of the dist.X node -> keywords
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Attribute) and _is_dist(node.func.value, aliases):
            called[id(node.func)] = _keywords(node)
        elif isinstance(node.func, ast.Attribute) and node.func.attr == "bounded":
            for arg in node.args:
                if isinstance(arg, ast.Attribute) and _is_dist(arg.value, aliases):
                    called[id(arg)] = _keywords(node)
    return [Use(str(path), node.lineno, node.attr, called.get(id(node), ()))
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and _is_dist(node.value, aliases)]


def problems(api: dict[str, Any], found: list[Use]) -> list[str]:
    """What ``found`` uses that torch.distributed as recorded in ``api`` lacks."""
    names = set(api["names"])
    out = []
    for use in found:
        where = f"{use.path}:{use.line}: torch.distributed.{use.name}"
        if use.name not in names:
            out.append(f"{where} does not exist in torch {api['torch']}")
            continue
        sig = api["functions"].get(use.name)
        if sig is None or sig["var_keyword"]:
            continue
        for kw in use.keywords:
            if kw not in sig["params"]:
                out.append(f"{where}({kw}=...): torch {api['torch']} has no parameter {kw!r} "
                           f"(it takes {', '.join(sig['params'])})")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "record":
        print(__doc__, file=sys.stderr)
        return 2
    json.dump(record(Path(argv[1])), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
