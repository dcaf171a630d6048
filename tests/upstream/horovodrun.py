"""Horovod's own launcher, ``horovodrun``, from Horovod's source release on PyPI, for the tests
that run ringcomm's processes under it.

    python tests/upstream/horovodrun.py --fetch DIR          # once: DIR/horovod/...
    python tests/upstream/horovodrun.py -np 2 python train.py   # horovodrun -np 2 python train.py

``--fetch`` downloads Horovod's source distribution with pip (``HOROVOD_VERSION``, no
dependencies, nothing built) and unpacks its Python package into DIR (``make`` puts it in
``.venv/horovod-src``). The launch runs horovodrun's command line
(``horovod.runner.launch.run_commandline``) with DIR first on the path, unchanged but for one
thing: horovodrun asks Horovod's compiled library whether it was built with Gloo before it starts
processes with its own launcher, and the source release has no library built; ringcomm's
processes load none of it, so that question is answered yes (and whether it was built with MPI,
no: horovodrun then starts the processes itself, as wherever Horovod was built without MPI, and
not through mpirun).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HOROVOD_VERSION = "0.28.1"
#: Where the tests look for the unpacked sources (``make`` puts them there).
DEFAULT_DIR = Path(__file__).resolve().parent.parent.parent / ".venv" / "horovod-src"


def source_dir() -> Path | None:
    """The unpacked sources (``HOROVODRUN_SOURCE``, else ``DEFAULT_DIR``), None where absent."""
    where = Path(os.environ.get("HOROVODRUN_SOURCE") or DEFAULT_DIR)
    return where if (where / "horovod" / "runner" / "launch.py").is_file() else None


def fetch(target: Path) -> None:
    """Download Horovod's source release and unpack its ``horovod`` package into ``target``."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", "-d", tmp, f"horovod=={HOROVOD_VERSION}"],
                       check=True)
        (archive,) = Path(tmp).glob("horovod-*.tar.gz")
        top = f"horovod-{HOROVOD_VERSION}/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers()
                       if m.isfile() and (m.name.startswith(top + "horovod/")
                                          or m.name == top + "LICENSE")]
            for member in members:
                member.name = member.name[len(top):]
            target.mkdir(parents=True, exist_ok=True)
            tar.extractall(target, members=members, filter="data")
    print(f"horovodrun {HOROVOD_VERSION} (Horovod's source release) unpacked in {target}")


def main() -> int:
    if sys.argv[1:2] == ["--fetch"]:
        fetch(Path(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_DIR)
        return 0
    where = source_dir()
    if where is None:
        print(f"no Horovod sources in {os.environ.get('HOROVODRUN_SOURCE') or DEFAULT_DIR}: "
              f"run {sys.argv[0]} --fetch first", file=sys.stderr)
        return 2
    sys.path.insert(0, str(where))
    import horovod.runner.launch as launch

    launch.gloo_built = lambda verbose=False: True
    launch.mpi_built = lambda verbose=False: False
    launch.run_commandline()
    return 0


if __name__ == "__main__":  # horovodrun starts its processes' watchers with multiprocessing
    sys.exit(main())
