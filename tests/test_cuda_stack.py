"""The CUDA stack of a machine, and the extra that installs it: ringcomm.ops._cuda_stack."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import types
from pathlib import Path

import pytest

from ringcomm.ops import _cuda_stack

ROOT = Path(__file__).resolve().parent.parent


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["project"]["optional-dependencies"]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]


@pytest.mark.parametrize("major", sorted(_cuda_stack.EXTRAS))
def test_extras_install_what_the_table_says(major):
    """pyproject.toml's cuda12 / cuda13 extras are CuPy, NCCL, NVRTC and the runtime headers
    of one CUDA major version, as PACKAGES lists them."""
    extra = _extras()[_cuda_stack.EXTRAS[major]]
    assert sorted(_name(r) for r in extra) == sorted(_cuda_stack.PACKAGES[major])


def test_cuda13_extra_stays_on_cuda_13():
    """The CUDA 13 wheels of NVRTC and the runtime have no -cu13 suffix: only a bound keeps
    a later major version out."""
    for requirement in _extras()["cuda13"]:
        if _name(requirement) in ("nvidia-cuda-nvrtc", "nvidia-cuda-runtime"):
            assert "<14" in requirement, requirement


def _installed(monkeypatch, dists: dict[str, str]) -> None:
    def version(dist: str) -> str:
        if dist not in dists:
            raise importlib.metadata.PackageNotFoundError(dist)
        return dists[dist]

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.delitem(sys.modules, "torch", raising=False)


@pytest.mark.parametrize(("dists", "driver", "expected"), [
    ({"cupy-cuda13x": "14.2.0", "nvidia-nccl-cu13": "2.32.3"}, 12, (13, "cupy-cuda13x")),
    ({"cupy-cuda12x": "14.2.0", "torch": "2.11.0+cu130"}, 13, (12, "cupy-cuda12x")),
    ({"nvidia-nccl-cu13": "2.32.3"}, None, (13, "nvidia-nccl-cu13")),
    ({"torch": "2.11.0+cu130"}, None, (13, "torch")),
    ({"torch": "2.8.0+cu128"}, 13, (12, "torch")),
    ({"torch": "2.13.0+cpu"}, 13, (13, "driver")),
    ({}, 12, (12, "driver")),
    ({}, None, (None, "")),
])
def test_detect_reads_the_installed_stack_first(monkeypatch, dists, driver, expected):
    _installed(monkeypatch, dists)
    monkeypatch.setattr(_cuda_stack, "_driver_major", lambda: driver)
    assert tuple(_cuda_stack.detect()) == expected


def test_detect_asks_an_imported_torch(monkeypatch):
    _installed(monkeypatch, {"torch": "2.13.0+cpu"})
    fake = types.SimpleNamespace(version=types.SimpleNamespace(cuda="13.0"))
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(_cuda_stack, "_driver_major", lambda: None)
    assert tuple(_cuda_stack.detect()) == (13, "torch")


@pytest.mark.parametrize(("major", "extra"), [(12, "cuda12"), (13, "cuda13"), (14, "cuda13"),
                                              (11, None), (None, None)])
def test_extra_for(major, extra):
    assert _cuda_stack.extra_for(major) == extra


def test_install_hint_names_the_extra(monkeypatch):
    assert _cuda_stack.install_hint(13) == "pip install 'ringcomm[cuda13]'"
    assert _cuda_stack.install_hint(12) == "pip install 'ringcomm[cuda12]'"
    monkeypatch.setattr(_cuda_stack, "detect", lambda: _cuda_stack.CudaStack(13, "driver"))
    assert _cuda_stack.install_hint() == "pip install 'ringcomm[cuda13]'"


def test_install_hint_without_a_known_version_names_both(monkeypatch):
    monkeypatch.setattr(_cuda_stack, "detect", lambda: _cuda_stack.CudaStack(None, ""))
    both = ("pip install 'ringcomm[cuda12]' (CUDA 12) or pip install 'ringcomm[cuda13]' "
            "(CUDA 13)")
    assert _cuda_stack.install_hint() == both
    assert _cuda_stack.install_hint(11) == (
        f"{both}; found CUDA 11 here, and ringcomm needs CUDA 12 or newer")


def test_header_dir_is_where_the_runtime_headers_are():
    """With the runtime wheel of the test extra, cuda.pathfinder finds cuda_runtime.h (what
    CuPy 14 compiles against)."""
    pytest.importorskip("cuda.pathfinder")
    found = _cuda_stack.header_dir()
    if found is None:
        pytest.skip("no CUDA runtime headers here (pip install nvidia-cuda-runtime-cu12)")
    assert (Path(found) / "cuda_runtime.h").is_file(), found


def test_header_dir_never_raises(monkeypatch):
    def broken(name: str) -> str:
        raise RuntimeError(f"cannot search for {name}")

    pathfinder = pytest.importorskip("cuda.pathfinder")
    monkeypatch.setattr(pathfinder, "find_nvidia_header_directory", broken)
    assert _cuda_stack.header_dir() is None
    monkeypatch.setattr(pathfinder, "find_nvidia_header_directory", lambda name: None)
    assert _cuda_stack.header_dir() is None
