"""Every kernel source compiles with NVRTC, for compute_80 and compute_90, with every name
expression ringcomm.ops.cuda launches, on any machine (no GPU needed).

NVRTC is called through CuPy's low-level binding (cupy_backends.cuda.libs.nvrtc), which loads
libnvrtc from the nvidia-cuda-nvrtc-cu12 wheel of the test extra, with the exact options and
sources ringcomm.ops.cuda hands to cupy.RawModule. A syntax or template error fails here.
"""

from __future__ import annotations

import pytest

from ringcomm.ops import _cuda_source

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc",
                            reason="needs CuPy (the test extra installs it)")

ARCHS = ("compute_80", "compute_90")
# What cupy.RawModule adds to the options it is given (besides the target architecture).
CUPY_ADDS = ("--device-as-default-execution-space",)


def _compile(source: str, arch: str) -> tuple[dict[str, str], bytes]:
    """Compile ``source``; return its lowered kernel names and its PTX."""
    names = _cuda_source.name_expressions(source)
    prog = nvrtc.createProgram(_cuda_source.read_source(source), source, [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *_cuda_source.OPTIONS,
                                        *CUPY_ADDS])
        except nvrtc.NVRTCError as err:
            pytest.fail(f"{source} ({arch}) does not compile: {err}\n{nvrtc.getProgramLog(prog)}")
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in names}
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return lowered, ptx if isinstance(ptx, bytes) else ptx.encode()


@pytest.fixture(scope="module")
def libnvrtc() -> None:
    try:
        nvrtc.getVersion()
    except Exception as err:  # the library itself could not be loaded
        pytest.skip(f"libnvrtc not found ({err}); pip install nvidia-cuda-nvrtc-cu12")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", _cuda_source.SOURCES)
def test_source_compiles_with_every_instantiation(libnvrtc, source, arch):
    lowered, ptx = _compile(source, arch)
    assert len(set(lowered.values())) == len(lowered)  # one kernel per name expression
    for name, symbol in lowered.items():
        assert f".entry {symbol}(".encode() in ptx, f"{name} ({symbol}) missing from the PTX"
    assert f".target sm_{arch[-2:]}".encode() in ptx


def test_headers_are_inlined():
    """Sources reach NVRTC self-contained: the local headers are pasted in, once."""
    for source in _cuda_source.SOURCES:
        text = _cuda_source.read_source(source)
        assert '#include "' not in text
        assert text.count("namespace rc {") >= 2  # the header's and the source's own
        assert text.count("struct half_t {") == 1


def test_every_launched_kernel_is_instantiated():
    """The kernel names ops/cuda.py builds at import are among the compiled expressions."""
    from ringcomm.ops import cuda

    compiled = {n for s in _cuda_source.SOURCES for n in _cuda_source.name_expressions(s)}
    launched = {*cuda._COPY.values(), *cuda._REDUCE.values(), *cuda._DIVIDE.values()}
    assert launched <= compiled
