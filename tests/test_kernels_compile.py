"""Every kernel source compiles with NVRTC into cubins for sm_80 and sm_90, with every name
expression ringcomm.ops.cuda launches, on any machine (no GPU needed).

The compile is the one ringcomm.ops._cuda_runtime runs on a GPU machine: ops/_kernel_cache.py's
NVRTC (CuPy's binding, cupy_backends.cuda.libs.nvrtc, which loads libnvrtc from the NVRTC wheel
of the test extra) with exactly ``_cuda_source.OPTIONS``. A syntax, template or ptxas error
fails here.
"""

from __future__ import annotations

import pytest

from ringcomm.ops import _cuda_source
from ringcomm.ops import _kernel_cache as kc

pytest.importorskip("cupy_backends.cuda.libs.nvrtc",
                    reason="needs CuPy (the test extra installs it)")

ARCHS = (80, 90)


@pytest.fixture(scope="module")
def nvrtc() -> kc.Nvrtc:
    try:
        return kc.nvrtc()
    except RuntimeError as err:  # the library itself could not be loaded
        pytest.skip(f"{err}; pip install nvidia-cuda-nvrtc-cu12")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", _cuda_source.SOURCES)
def test_source_compiles_with_every_instantiation(nvrtc, tmp_path, source, arch):
    try:
        compiled = kc.load_source(source, kc.Target(arch, "cubin"), compiler=nvrtc,
                                  directory=tmp_path)
    except RuntimeError as err:
        pytest.fail(f"{source} (sm_{arch}) does not compile: {err}")
    lowered = compiled.lowered
    assert set(lowered) == set(_cuda_source.name_expressions(source))
    assert len(set(lowered.values())) == len(lowered)  # one kernel per name expression
    assert compiled.image.startswith(b"\x7fELF")
    for name, symbol in lowered.items():
        assert f".text.{symbol}\0".encode() in compiled.image, f"{name} ({symbol}) not in the cubin"


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
