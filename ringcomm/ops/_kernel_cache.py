"""The kernels compiled once per machine: NVRTC output kept on disk, keyed by what made it.

ringcomm compiles its CUDA sources itself, with NVRTC and exactly ``_cuda_source.OPTIONS``
(C++17, ``--fmad=false``, ``--ftz=false``), rather than through ``cupy.RawModule``, which always
adds ``-ftz=true`` and so flushes float32 subnormals that NumPy keeps. The result is a cubin for
the device's architecture (PTX for the newest architecture NVRTC knows when the device is newer
than this NVRTC; the driver finishes that one), stored with NVRTC's lowered names of the kernels
in one file per source. A file's name and header carry a SHA-256 key over the source text, the
name expressions, the options, the target and the NVRTC version, so any change compiles anew;
its body is checked against a SHA-256 of its own, so a damaged file is compiled and written
again. Writers write a temporary file and ``os.replace`` it (readers see a whole file or none);
processes that miss together wait on a lock file while one of them compiles.

The cache lives in ``$RINGCOMM_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/ringcomm/kernels``, else
``~/.cache/ringcomm/kernels``. Nothing here needs a GPU or CuPy's runtime: NVRTC compiles for any
architecture, so all of it runs in the tests on machines without one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ringcomm.core.log import get_logger
from ringcomm.ops import _cuda_source as _src

__all__ = [
    "ENV_VAR",
    "FORMAT",
    "Compiled",
    "Compiler",
    "Nvrtc",
    "Target",
    "cache_dir",
    "cache_key",
    "load",
    "load_source",
    "nvrtc",
    "target_for",
]

#: The environment variable that names the cache directory.
ENV_VAR = "RINGCOMM_KERNEL_CACHE"
#: Version of the file layout below; part of every key.
FORMAT = 1
# File layout: magic, 4-byte little-endian header length, a JSON header (key, kind, lowered
# names, the image's size and SHA-256), then the image itself.
_MAGIC = b"RCKERNEL"
_LEN = 4
_KINDS = ("cubin", "ptx")
_LOG = get_logger("ops.kernels")


@dataclass(frozen=True)
class Target:
    """What NVRTC compiles for: ``arch`` (e.g. 90) as a cubin ("sm_90") or as PTX
    ("compute_90")."""

    arch: int
    kind: str = "cubin"

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be 'cubin' or 'ptx', got {self.kind!r}")

    @property
    def option(self) -> str:
        """The NVRTC option that selects this target."""
        prefix = "sm" if self.kind == "cubin" else "compute"
        return f"--gpu-architecture={prefix}_{self.arch}"


def target_for(capability: int, supported: Iterable[int]) -> Target:
    """The target for a device of compute ``capability`` (e.g. 90) given the architectures
    NVRTC supports: a cubin for the device's own architecture when NVRTC knows it (or does not
    say), else PTX for the newest architecture NVRTC knows below it (which the driver compiles
    on load).

    Raises:
        ValueError: NVRTC supports no architecture at or below ``capability``.
    """
    archs = sorted(int(a) for a in supported)
    if not archs or capability in archs:
        return Target(capability, "cubin")
    older = [a for a in archs if a < capability]
    if not older:
        raise ValueError(f"this NVRTC compiles for {archs}, nothing for compute capability "
                         f"{capability}")
    return Target(older[-1], "ptx")


@dataclass(frozen=True)
class Compiled:
    """A compiled source: its ``image`` (cubin or PTX, per ``kind``) and, for each name
    expression, the symbol NVRTC gave that kernel. ``from_cache`` says whether it was read from
    the disk cache rather than compiled."""

    image: bytes
    kind: str
    lowered: Mapping[str, str]
    from_cache: bool = field(default=False, compare=False)


class Compiler(Protocol):
    """What ``load`` needs of NVRTC (``Nvrtc`` is the real one)."""

    def version(self) -> tuple[int, int]:
        """NVRTC's (major, minor) version."""
        ...

    def compile(self, text: str, filename: str, names: Sequence[str], options: Sequence[str],
                kind: str) -> tuple[bytes, dict[str, str]]:
        """Compile ``text``; return the image and the lowered name of each name expression."""
        ...


class Nvrtc:
    """NVRTC through CuPy's binding (``cupy_backends.cuda.libs.nvrtc``); needs no GPU.

    Raises:
        RuntimeError: CuPy or the NVRTC library is missing.
    """

    def __init__(self) -> None:
        try:
            from cupy_backends.cuda.libs import nvrtc as lib

            self._version = tuple(int(v) for v in lib.getVersion())
        except Exception as err:  # ImportError, or libnvrtc not found when first called
            raise RuntimeError(f"ringcomm compiles its CUDA kernels with NVRTC, which could not "
                               f"be loaded ({err}); install CuPy with the NVRTC of its CUDA "
                               "version") from err
        self._lib: Any = lib

    def version(self) -> tuple[int, int]:
        """NVRTC's (major, minor) version."""
        return self._version[0], self._version[1]

    def supported_archs(self) -> tuple[int, ...]:
        """The architectures this NVRTC compiles for (e.g. 50 ... 121); empty when it cannot
        tell (NVRTC before 11.2)."""
        try:
            return tuple(int(a) for a in self._lib.getSupportedArchs())
        except Exception:  # the entry point is missing from an old libnvrtc
            return ()

    def compile(self, text: str, filename: str, names: Sequence[str], options: Sequence[str],
                kind: str) -> tuple[bytes, dict[str, str]]:
        """Compile ``text`` into a cubin or PTX (``kind``) with ``options``.

        Raises:
            RuntimeError: the source does not compile (NVRTC's log is in the message).
        """
        lib = self._lib
        prog = lib.createProgram(text, filename, [], [])
        try:
            for name in names:
                lib.addNameExpression(prog, name)
            try:
                lib.compileProgram(prog, list(options))
            except lib.NVRTCError as err:
                raise RuntimeError(f"NVRTC could not compile {filename} ({err}):\n"
                                   f"{lib.getProgramLog(prog)}") from err
            lowered = {name: lib.getLoweredName(prog, name) for name in names}
            image = lib.getCUBIN(prog) if kind == "cubin" else lib.getPTX(prog)
        finally:
            lib.destroyProgram(prog)
        return (image if isinstance(image, bytes) else image.encode()), lowered


@functools.cache
def nvrtc() -> Nvrtc:
    """This process's NVRTC (loaded once)."""
    return Nvrtc()


def cache_dir() -> Path:
    """The cache directory: ``$RINGCOMM_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/ringcomm/kernels``,
    else ``~/.cache/ringcomm/kernels`` (created when first written)."""
    chosen = os.environ.get(ENV_VAR)
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ringcomm" / "kernels"


def cache_key(text: str, names: Sequence[str], options: Sequence[str], target: Target,
              version: tuple[int, int]) -> str:
    """The hex SHA-256 that names a compiled source: over everything that shapes its image."""
    spec = {"format": FORMAT, "names": list(names), "options": list(options),
            "target": target.option, "kind": target.kind, "nvrtc": list(version),
            "source": hashlib.sha256(text.encode()).hexdigest()}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


class _Damaged(Exception):
    """A cache file that is not a whole, matching entry."""


def _encode(key: str, compiled: Compiled) -> bytes:
    header = json.dumps({"key": key, "kind": compiled.kind, "lowered": dict(compiled.lowered),
                         "size": len(compiled.image),
                         "sha256": hashlib.sha256(compiled.image).hexdigest()}).encode()
    return b"".join([_MAGIC, len(header).to_bytes(_LEN, "little"), header, compiled.image])


def _decode(data: bytes, key: str, names: Sequence[str]) -> Compiled:
    """The entry in ``data``.

    Raises:
        _Damaged: wrong magic, a header that does not parse or name ``key``, a body of the
            wrong size or hash, or lowered names missing.
    """
    if not data.startswith(_MAGIC):
        raise _Damaged("not a ringcomm kernel file")
    start = len(_MAGIC) + _LEN
    size = int.from_bytes(data[len(_MAGIC):start], "little")
    try:
        header = json.loads(data[start:start + size])
        image = data[start + size:]
        ok = (header["key"] == key and header["kind"] in _KINDS
              and header["size"] == len(image)
              and header["sha256"] == hashlib.sha256(image).hexdigest()
              and all(isinstance(header["lowered"].get(n), str) for n in names))
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise _Damaged(f"unreadable header ({err})") from err
    if not ok:
        raise _Damaged("header and contents do not match")
    return Compiled(image, header["kind"], header["lowered"], from_cache=True)


def _read(path: Path, key: str, names: Sequence[str], *, quiet: bool = False) -> Compiled | None:
    """The entry at ``path``, or None when there is none or it is damaged (logged unless
    ``quiet``)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        if not quiet:
            _LOG.warning("cannot read the cached kernels %s (%s); compiling", path, err)
        return None
    try:
        return _decode(data, key, names)
    except _Damaged as err:
        if not quiet:
            _LOG.warning("cached kernels %s are damaged (%s); compiling them again", path, err)
        return None


def _write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all: a temporary file of this writer's own,
    then an atomic rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from a shared cache's other users
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` + ".lock" where the platform and file system allow
    (fcntl); elsewhere, or when the directory cannot be written, go on without one (the atomic
    write still keeps files whole; the lock only spares concurrent processes the same compile)."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_name(path.name + ".lock"), "a+b")
    except (ImportError, OSError):
        yield
        return
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except OSError:  # e.g. a network file system without locks
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def load(name: str, text: str, names: Sequence[str], target: Target, *,
         compiler: Compiler | None = None, directory: Path | None = None) -> Compiled:
    """Source ``text`` (called ``name``) compiled for ``target`` with ``_cuda_source.OPTIONS``,
    from the disk cache when an entry for exactly this source, these name expressions, options,
    target and NVRTC version is there, else compiled and stored.

    Args:
        name: the source's file name (in messages and the cache file's name).
        text: the complete source (headers inlined).
        names: the name expressions to instantiate and look up.
        target: the architecture and image kind.
        compiler: NVRTC (default: ``nvrtc()``).
        directory: the cache directory (default: ``cache_dir()``).

    Returns:
        The image and the lowered names. A cache that cannot be written only costs a warning.

    Raises:
        RuntimeError: NVRTC is missing or the source does not compile.
    """
    compiler = compiler if compiler is not None else nvrtc()
    version = compiler.version()
    options = (target.option, *_src.OPTIONS)
    key = cache_key(text, names, options, target, version)
    stem = Path(name).stem
    path = (directory if directory is not None else cache_dir()) / (
        f"{stem}-{target.kind}_{target.arch}-nvrtc{version[0]}.{version[1]}-{key[:24]}.bin")
    hit = _read(path, key, names)
    if hit is not None:
        return hit
    with _locked(path):
        hit = _read(path, key, names, quiet=True)  # another process may have written it
        if hit is not None:
            return hit
        start = time.perf_counter()
        image, lowered = compiler.compile(text, name, names, options, target.kind)
        compiled = Compiled(image, target.kind, lowered)
        _LOG.info("compiled %s for %s in %.2f s", name, target.option.split("=")[1],
                  time.perf_counter() - start)
        try:
            _write(path, _encode(key, compiled))
        except OSError as err:
            _LOG.warning("cannot store compiled kernels in %s (%s); every process will compile "
                         "them (set %s to a writable directory)", path.parent, err, ENV_VAR)
        return compiled


def load_source(source: str, target: Target, *, compiler: Compiler | None = None,
                directory: Path | None = None) -> Compiled:
    """Kernel source ``source`` (one of ``_cuda_source.SOURCES``) with every instantiation
    ringcomm launches, as ``load`` gives it."""
    return load(source, _src.read_source(source), _src.name_expressions(source), target,
                compiler=compiler, directory=directory)
