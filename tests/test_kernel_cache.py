"""The kernel cache (ringcomm/ops/_kernel_cache.py) with the real NVRTC, on a machine without a
GPU: NVRTC compiles cubins for sm_90 here as it does on an H100.

A second load, in this process or another, reads the cache instead of compiling; a changed
source, name list, architecture or NVRTC version compiles anew; a damaged file is compiled and
written again; concurrent processes never see a torn file, and those that miss together compile
once. ``ringcomm.ops._cuda_runtime`` loads what the cache gives into CuPy's module object (a
stand-in here) and looks kernels up by NVRTC's lowered names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import gpu_emulator
import pytest

from ringcomm.ops import _cuda_runtime as _rt
from ringcomm.ops import _cuda_source as _src
from ringcomm.ops import _kernel_cache as kc

ROOT = Path(__file__).resolve().parent.parent
SM90 = kc.Target(90, "cubin")
SOURCE = "cast.cu"  # the smallest source: about a quarter of a second per compile


@pytest.fixture(scope="module")
def real() -> kc.Nvrtc:
    """This machine's NVRTC (skip without it)."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="needs CuPy (the test extra)")
    try:
        return kc.nvrtc()
    except RuntimeError as err:
        pytest.skip(str(err))


class Counting:
    """The real NVRTC, counting its compiles and the options they got; ``version`` may be set
    to stand for another NVRTC release."""

    def __init__(self, inner: kc.Nvrtc, version: tuple[int, int] | None = None) -> None:
        self.inner, self._version = inner, version
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def version(self) -> tuple[int, int]:
        return self._version or self.inner.version()

    def compile(self, text: str, filename: str, names: Sequence[str], options: Sequence[str],
                kind: str) -> tuple[bytes, dict[str, str]]:
        self.calls.append((filename, tuple(options)))
        return self.inner.compile(text, filename, names, options, kind)


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.bin"))


def test_second_load_reads_the_cache(real, tmp_path):
    nvrtc = Counting(real)
    first = kc.load_source(SOURCE, SM90, compiler=nvrtc, directory=tmp_path)
    assert not first.from_cache and len(nvrtc.calls) == 1
    assert first.kind == "cubin" and first.image.startswith(b"\x7fELF")
    assert set(first.lowered) == set(_src.name_expressions(SOURCE))
    (entry,) = _entries(tmp_path)
    assert "cubin_90" in entry.name and "nvrtc" in entry.name
    again = kc.load_source(SOURCE, SM90, compiler=nvrtc, directory=tmp_path)
    assert again.from_cache and len(nvrtc.calls) == 1
    assert again == first  # the same image and lowered names


def test_another_process_loads_from_the_cache(real, tmp_path):
    """A fresh process finds the image the first one compiled, and compiles nothing (no
    timing: under a loaded machine's suite the load once took 2 s)."""
    kc.load_source(SOURCE, SM90, compiler=real, directory=tmp_path)
    script = textwrap.dedent("""
        import hashlib, json
        from ringcomm.ops import _kernel_cache as kc
        loaded = kc.load_source("cast.cu", kc.Target(90, "cubin"))
        print(json.dumps({"from_cache": loaded.from_cache,
                          "sha": hashlib.sha256(loaded.image).hexdigest(),
                          "lowered": dict(loaded.lowered)}))
    """)
    env = dict(os.environ, **{kc.ENV_VAR: str(tmp_path)})
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    want = kc.load_source(SOURCE, SM90, compiler=real, directory=tmp_path)
    assert report["from_cache"], "the second process compiled again"
    assert report["sha"] == hashlib.sha256(want.image).hexdigest()
    assert report["lowered"] == dict(want.lowered)


def _changed(change: str, real: kc.Nvrtc) -> dict:
    """Arguments of ``kc.load`` differing from the baseline in one respect."""
    text = _src.read_source(SOURCE)
    names = list(_src.name_expressions(SOURCE))
    args = {"text": text, "names": names, "target": SM90, "compiler": Counting(real)}
    if change == "source":
        args["text"] = text + "\n// one more line\n"
    elif change == "names":
        args["names"] = names[:2]
    elif change == "arch":
        args["target"] = kc.Target(80, "cubin")
    elif change == "kind":
        args["target"] = kc.Target(90, "ptx")
    elif change == "nvrtc":
        major, minor = real.version()
        args["compiler"] = Counting(real, (major, minor + 1))
    return args


@pytest.mark.parametrize("change", ["source", "names", "arch", "kind", "nvrtc"])
def test_any_change_compiles_anew(real, tmp_path, change):
    base = _changed("none", real)
    kc.load(SOURCE, directory=tmp_path, **base)
    other = _changed(change, real)
    loaded = kc.load(SOURCE, directory=tmp_path, **other)
    assert not loaded.from_cache and len(other["compiler"].calls) == 1
    assert len(_entries(tmp_path)) == 2  # the first entry stays valid beside it
    assert kc.load(SOURCE, directory=tmp_path, **base).from_cache
    assert kc.load(SOURCE, directory=tmp_path, **other).from_cache
    if change == "kind":
        assert loaded.image.lstrip().startswith(b"//") and b".target sm_90" in loaded.image


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped":  # one bit of the image, near its end
        path.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])
    elif how == "header":
        path.write_bytes(data[:12] + b"{not json" + data[21:])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "foreign":  # a plain cubin where an entry belongs
        path.write_bytes(b"\x7fELF" + data[4:])


@pytest.mark.parametrize("how", ["truncated", "flipped", "header", "empty", "foreign"])
def test_damaged_entry_is_compiled_again(real, tmp_path, caplog, how):
    nvrtc = Counting(real)
    good = kc.load_source(SOURCE, SM90, compiler=nvrtc, directory=tmp_path)
    (entry,) = _entries(tmp_path)
    _damage(entry, how)
    with caplog.at_level(logging.WARNING, logger="ringcomm.ops.kernels"):
        again = kc.load_source(SOURCE, SM90, compiler=nvrtc, directory=tmp_path)
    assert not again.from_cache and len(nvrtc.calls) == 2
    assert again.lowered == good.lowered and again.image.startswith(b"\x7fELF")
    assert "damaged" in caplog.text
    assert kc.load_source(SOURCE, SM90, compiler=nvrtc, directory=tmp_path).from_cache
    assert len(nvrtc.calls) == 2  # repaired on disk


_WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from ringcomm.ops import _kernel_cache as kc
    path, key, me, rounds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    image = bytes([me]) * (4 << 20)  # big enough that a plain write would be seen half done
    data = kc._encode(key, kc.Compiled(image, "cubin", {"k": f"writer{me}"}))
    for _ in range(rounds):
        kc._write(path, data)
""")


def test_concurrent_writers_never_leave_a_torn_file(tmp_path):
    path, key = tmp_path / "entry.bin", "k" * 64
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), key, str(i), "15"],
                                cwd=ROOT) for i in range(1, 4)]
    seen, reads = set(), 0
    try:
        while any(w.poll() is None for w in writers):
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            entry = kc._decode(data, key, ["k"])  # raises on a torn file
            assert entry.image == bytes([entry.image[0]]) * len(entry.image)
            seen.add(entry.lowered["k"])
            reads += 1
    finally:
        for w in writers:
            w.wait(timeout=120)
    assert all(w.returncode == 0 for w in writers)
    assert reads > 0 and seen <= {"writer1", "writer2", "writer3"}
    assert [p.name for p in tmp_path.iterdir()] == ["entry.bin"]  # no temporary file left


_RACER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from ringcomm.ops import _kernel_cache as kc

    class Slow:  # a compile that takes a while, logged to a file per call
        def version(self):
            return (99, 0)
        def compile(self, text, filename, names, options, kind):
            with open(sys.argv[2], "a") as log:
                log.write("compile\\n")
            time.sleep(0.5)
            return b"image", {n: "sym" for n in names}

    loaded = kc.load("x.cu", "source", ["a"], kc.Target(90), compiler=Slow(),
                     directory=Path(sys.argv[1]))
    assert loaded.image == b"image"
""")


def test_processes_that_miss_together_compile_once(tmp_path):
    log = tmp_path / "compiles.log"
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, str(tmp_path / "cache"), str(log)],
                               cwd=ROOT) for _ in range(3)]
    assert all(r.wait(timeout=120) == 0 for r in racers)
    assert log.read_text().count("compile") == 1


def test_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv(kc.ENV_VAR, str(tmp_path / "mine"))
    assert kc.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv(kc.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kc.cache_dir() == tmp_path / "xdg" / "ringcomm" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kc.cache_dir() == tmp_path / "home" / ".cache" / "ringcomm" / "kernels"


def test_unwritable_cache_still_gives_the_kernels(real, tmp_path, caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    nvrtc = Counting(real)
    with caplog.at_level(logging.WARNING, logger="ringcomm.ops.kernels"):
        loaded = kc.load_source(SOURCE, SM90, compiler=nvrtc, directory=blocker / "kernels")
    assert loaded.image.startswith(b"\x7fELF") and len(nvrtc.calls) == 1
    assert "cannot store" in caplog.text


def test_target_for_a_device():
    assert kc.target_for(90, [80, 86, 90]) == kc.Target(90, "cubin")
    assert kc.target_for(100, [80, 90]) == kc.Target(90, "ptx")  # a device newer than NVRTC
    assert kc.target_for(90, []) == kc.Target(90, "cubin")  # an NVRTC that cannot tell
    with pytest.raises(ValueError, match="compute capability 70"):
        kc.target_for(70, [80, 90])
    assert kc.Target(90).option == "--gpu-architecture=sm_90"
    assert kc.Target(80, "ptx").option == "--gpu-architecture=compute_80"


def test_kernels_are_compiled_without_flush_to_zero(real, tmp_path):
    """The options ringcomm compiles with keep float32 subnormals (no .ftz instruction in the
    PTX), unlike CuPy's RawModule, which adds -ftz=true; the emulator computes as they say."""
    nvrtc = Counting(real)
    ptx = kc.load_source("quantize.cu", kc.Target(90, "ptx"), compiler=nvrtc,
                         directory=tmp_path).image
    ((_, options),) = nvrtc.calls
    assert options == ("--gpu-architecture=compute_90", *_src.OPTIONS)
    assert "--fmad=false" in options and "--std=c++17" in options
    assert b".ftz" not in ptx
    assert not gpu_emulator.flushes_subnormals(options)
    cupy_default = (*options, "-ftz=true")
    flushed, _ = real.compile(_src.read_source("quantize.cu"), "quantize.cu",
                              _src.name_expressions("quantize.cu"), cupy_default, "ptx")
    assert b"max.ftz.f32" in flushed and b"div.rn.ftz.f32" in flushed
    assert gpu_emulator.flushes_subnormals(cupy_default)


# ------------------------------------------------------------ the runtime over the cache
class _Module:
    """Stands for cupy.cuda.function.Module: records what is loaded and looked up."""

    loads: ClassVar[list[bytes]] = []

    def __init__(self) -> None:
        self.symbols: list[str] = []

    def load(self, image: bytes) -> None:
        _Module.loads.append(image)

    def get_function(self, symbol: str) -> tuple[str, str]:
        self.symbols.append(symbol)
        return ("kernel", symbol)


class _Cupy:
    """The part of CuPy the runtime's loading touches, for a compute capability 9.0 device."""

    class cuda:
        class runtime:
            @staticmethod
            def getDevice() -> int:
                return 0

        class Device:
            def __init__(self, device: int) -> None:
                self.compute_capability = "90"

        class function:
            Module = _Module


def test_runtime_loads_cached_cubins_by_lowered_name(real, tmp_path, monkeypatch):
    monkeypatch.setenv(kc.ENV_VAR, str(tmp_path))
    monkeypatch.setattr(_rt, "_cupy", _Cupy)
    for table in ("_modules", "_functions", "_targets"):
        monkeypatch.setattr(_rt, table, {})
    _Module.loads.clear()
    hop, decode = _src.cast_name("hop", "f16"), _src.cast_name("decode", "bf16")
    start = time.perf_counter()
    fn = _rt.function(hop)
    cold = time.perf_counter() - start
    want = kc.load_source(SOURCE, SM90, compiler=real, directory=tmp_path)
    assert want.from_cache  # the runtime stored it
    assert fn == ("kernel", want.lowered[hop]) and fn[1].startswith("_Z")
    assert _rt.function(decode) == ("kernel", want.lowered[decode])
    assert _Module.loads == [want.image]  # one module per source and device
    monkeypatch.setattr(_rt, "_modules", {})  # as a new process would start
    monkeypatch.setattr(_rt, "_functions", {})
    start = time.perf_counter()
    assert _rt.function(hop) == fn
    warm = time.perf_counter() - start
    assert _Module.loads == [want.image, want.image]
    assert warm < max(0.5, cold)
