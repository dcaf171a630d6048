"""The wheel ships the CUDA sources, and an installed copy finds and compiles them.

Builds the wheel from a copy of the source tree, installs it into a fresh virtual environment,
and there reads every kernel source through ``ringcomm.ops._cuda_source`` (importlib.resources
on ``ringcomm._kernels``) and compiles one with NVRTC: what ``ringcomm.ops.cuda`` does on a GPU
machine, short of loading the module onto a device.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from exit_checks import run_bounded

from ringcomm.ops import _cuda_source

ROOT = Path(__file__).resolve().parent.parent

_CHECK = """
import importlib.resources, json, os, site, sys
import ringcomm
# libnvrtc comes from the test venv's nvidia wheel, which CuPy looks for in site-packages.
_site = site.getsitepackages
site.getsitepackages = lambda: [*_site(), os.environ["RINGCOMM_TEST_SITE"]]
from ringcomm.ops import _cuda_source as src
shipped = sorted(p.name for p in importlib.resources.files("ringcomm._kernels").iterdir())
sizes = {s: len(src.read_source(s)) for s in src.SOURCES}
compiled = None
try:
    from cupy_backends.cuda.libs import nvrtc
except ImportError:
    pass
else:
    prog = nvrtc.createProgram(src.read_source("topk.cu"), "topk.cu", [], [])
    for name in src.name_expressions("topk.cu"):
        nvrtc.addNameExpression(prog, name)
    nvrtc.compileProgram(prog, ["--gpu-architecture=compute_80", *src.OPTIONS])
    compiled = len(nvrtc.getPTX(prog))
print(json.dumps({"file": ringcomm.__file__, "shipped": shipped, "sizes": sizes,
                  "compiled": compiled}))
"""


def _copy_tree(dst: Path) -> None:
    """The files the wheel is built from (not .venv, .git, build outputs)."""
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dst / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for tree in ("ringcomm", "kernels"):
        shutil.copytree(ROOT / tree, dst / tree, ignore=ignore)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    out = tmp_path_factory.mktemp("wheel")
    _copy_tree(src)
    # No build isolation: the test venv's setuptools builds it, so no network is needed.
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
           "--quiet", "--wheel-dir", str(out), str(src)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (built,) = out.glob("ringcomm-*.whl")
    return built


@pytest.mark.slow
def test_wheel_ships_the_kernel_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"ringcomm/_kernels/{s}" for s in _cuda_source.SOURCES}
    expected |= {f"ringcomm/_kernels/{p.name}" for p in (ROOT / "kernels").glob("*.cuh")}
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    assert "ringcomm/ops/_cuda_source.py" in names and "ringcomm/ops/cuda.py" in names


@pytest.mark.slow
def test_installed_package_finds_and_compiles_its_kernels(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)  # pip below runs from the test venv, --python there
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                    "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    # NumPy and CuPy's NVRTC binding come from the test venv; ringcomm from the fresh one
    # (the test venv's editable install is a .pth hook, which PYTHONPATH does not run).
    test_site = sysconfig.get_paths()["purelib"]
    env = dict(os.environ, PYTHONPATH=test_site, RINGCOMM_TEST_SITE=test_site)
    env.pop("PYTHONHOME", None)
    run = subprocess.run([str(python), "-c", _CHECK], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert Path(report["file"]).is_relative_to(env_dir), report["file"]
    assert set(_cuda_source.SOURCES) <= set(report["shipped"])
    assert all(size > 1000 for size in report["sizes"].values())
    try:
        import cupy_backends.cuda.libs.nvrtc  # noqa: F401
    except ImportError:
        return
    assert report["compiled"], "the installed topk.cu did not compile"


@pytest.mark.slow
def test_installed_benchmark_runs_from_outside_the_tree(wheel, tmp_path):
    """What a pip user does: the wheel with its mpi extra into a new virtual environment
    (dependencies from the package index), then the benchmark under that environment's
    mpiexec, from a directory that holds no source."""
    from test_perf import _check_output

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)  # pip below runs from the test venv, --python there
    bin_dir = env_dir / "bin"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
           and not k.startswith(("PMI_", "OMPI_", "PMIX_", "HYDRA_"))}
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install", "--quiet",
         "--disable-pip-version-check", f"{wheel}[mpi]"],
        env=env, capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stdout + install.stderr
    work = tmp_path / "elsewhere"
    work.mkdir()
    run = run_bounded([str(bin_dir / "mpiexec"), "-n", "2", str(bin_dir / "ringcomm-perf"),
                       "-b", "8", "-e", "16M", "-f", "4"],
                      cwd=work, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    _check_output(run.stdout, 11)  # 8 B to 8 MiB
    where = subprocess.run(
        [str(bin_dir / "python"), "-c", "import ringcomm; print(ringcomm.__file__)"],
        cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert Path(where.stdout.strip()).is_relative_to(env_dir), where.stdout + where.stderr


@pytest.mark.slow
def test_wheel_carries_the_licence_metadata_and_command(wheel):
    import ringcomm

    archive = zipfile.ZipFile(wheel)
    info = f"ringcomm-{ringcomm.__version__}.dist-info"
    names = set(archive.namelist())
    assert f"{info}/licenses/LICENSE" in names, sorted(n for n in names if "dist-info" in n)
    assert "Apache License" in archive.read(f"{info}/licenses/LICENSE").decode()
    meta = archive.read(f"{info}/METADATA").decode()
    assert f"Version: {ringcomm.__version__}" in meta  # the one version, from the package
    assert "License-Expression: Apache-2.0" in meta
    assert "Classifier: Typing :: Typed" in meta and "Requires-Python: >=3.10" in meta
    scripts = archive.read(f"{info}/entry_points.txt").decode()
    assert "ringcomm-perf = ringcomm.perf.run:main" in scripts
    assert "ringcomm/py.typed" in names and "ringcomm/perf/__main__.py" in names


def test_the_kernels_folder_never_hides_an_installed_kernels_package(tmp_path):
    """The checkout's root on sys.path (the tests' PYTHONPATH, a script run from the root)
    must not make ``kernels/`` the ``kernels`` every module imports: Transformers 5.25 imports
    Hugging Face's ``kernels`` package, and found the CUDA sources' folder instead (ImportError
    at ``import transformers.Trainer``). Without an ``__init__.py`` the folder is a namespace
    portion, which a package installed later on the path takes precedence over."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("INSTALLED = True\n")
    code = "import kernels; print(getattr(kernels, 'INSTALLED', kernels.__path__))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=60)
    assert found.stdout.strip() == "True", found.stdout + found.stderr
    assert not (ROOT / "kernels" / "__init__.py").exists()
