"""Every kernel source compiles with NVRTC, with every name expression ringcomm.ops.cuda
launches, on any machine (no GPU needed): into a cubin for sm_90 (the GPU check's H100/H200)
and into PTX for sm_80 (A100: the same front end for that architecture, without the
assembler's second pass over the same code, 40% of the time there).

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

TARGETS = (kc.Target(90, "cubin"), kc.Target(80, "ptx"))


@pytest.fixture(scope="module")
def nvrtc() -> kc.Nvrtc:
    try:
        return kc.nvrtc()
    except RuntimeError as err:  # the library itself could not be loaded
        pytest.skip(f"{err}; pip install nvidia-cuda-nvrtc-cu12")


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"{t.kind}_{t.arch}")
@pytest.mark.parametrize("source", _cuda_source.SOURCES)
def test_source_compiles_with_every_instantiation(nvrtc, tmp_path, source, target):
    try:
        compiled = kc.load_source(source, target, compiler=nvrtc, directory=tmp_path)
    except RuntimeError as err:
        pytest.fail(f"{source} ({target.option}) does not compile: {err}")
    lowered = compiled.lowered
    assert set(lowered) == set(_cuda_source.name_expressions(source))
    assert len(set(lowered.values())) == len(lowered)  # one kernel per name expression
    if target.kind == "cubin":
        assert compiled.image.startswith(b"\x7fELF")
        marks = {name: f".text.{symbol}\0".encode() for name, symbol in lowered.items()}
    else:
        assert f".target sm_{target.arch}".encode() in compiled.image
        marks = {name: f".entry {symbol}(".encode() for name, symbol in lowered.items()}
    for name, mark in marks.items():
        assert mark in compiled.image, f"{name} ({lowered[name]}) not in the {target.kind}"


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
