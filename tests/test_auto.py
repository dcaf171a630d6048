"""The "auto" selector's decisions on synthetic link and throughput figures."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import ringcomm
from ringcomm.comm.base import Communicator
from ringcomm.comm.threads import run_ranks
from ringcomm.compress.auto import Auto, LinkModel, predict, wire_bytes

INT8, FP16, TOPK = ringcomm.Int8(), ringcomm.FP16(), ringcomm.TopK(0.01)
CPU = {"none": 10e9, repr(FP16): 0.7e9, repr(INT8): 2.5e9, repr(TOPK): 1.0e9}
GBIT = LinkModel(latency=50e-6, bandwidth=125e6)          # 1 Gbit/s Ethernet
FAST = LinkModel(latency=2e-6, bandwidth=40e9)           # shared memory


def auto(link: LinkModel, candidates=(None, FP16, INT8)) -> Auto:
    return Auto(candidates, link=link, throughput=CPU)


def test_slow_link_large_messages_compress():
    assert auto(GBIT).choose(64 << 20, 4) == INT8
    assert auto(GBIT, (None, FP16, INT8, TOPK)).choose(64 << 20, 4) == TOPK


def test_small_messages_stay_dense():
    assert auto(GBIT).choose(4 << 10, 4) is None


def test_fast_link_stays_dense():
    for nbytes in (4 << 10, 1 << 20, 64 << 20, 256 << 20):
        assert auto(FAST).choose(nbytes, 4) is None


def test_choice_is_the_cheapest_prediction():
    a = auto(GBIT, (None, FP16, INT8, TOPK))
    for nbytes in (1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 28):
        times = {a.key(c): predict(c, nbytes, 8, GBIT, CPU[a.key(c)]) for c in a.candidates}
        assert a.key(a.choose(nbytes, 8)) == min(times, key=times.get)


def test_wire_model():
    assert wire_bytes(None, 4096, 4) == 1024
    assert wire_bytes(INT8, 4096, 4) == INT8.nbytes(256)
    assert wire_bytes(TOPK, 4 << 20, 4) == 8 * TOPK.k_for((1 << 20) // 4)
    assert GBIT.step(125e6) == pytest.approx(1 + 50e-6)


def test_allowed_only():
    """Auto never picks what the user did not allow."""
    assert auto(GBIT, (None, FP16)).choose(64 << 20, 4) == FP16
    assert auto(GBIT, (None,)).choose(64 << 20, 4) is None


def test_bad_candidates():
    with pytest.raises(ValueError, match="at least one candidate"):
        Auto(())
    with pytest.raises(TypeError, match="compressors or None"):
        Auto((None, "int8"))
    with pytest.raises(RuntimeError, match="no link/throughput figures"):
        Auto().choose(1 << 20, 2)
    with pytest.raises(NotImplementedError):
        Auto().compress(None)


def test_fixed_throughput_must_cover_every_candidate():
    """A missing figure is refused when the Auto is made, not as a KeyError inside a call on
    one rank (where the others would wait for it)."""
    link = LinkModel(1e-5, 1e9)
    with pytest.raises(ValueError, match=r"no figure for candidates \['Int8"):
        Auto((None, ringcomm.Int8()), link=link, throughput={"none": 1e9})


def test_candidates_must_name_a_known_algorithm():
    class Unknown(ringcomm.Int8):
        @property
        def allreduce_algorithm(self) -> str:
            return "no-such-algorithm"

    with pytest.raises(ValueError, match="names allreduce algorithm 'no-such-algorithm'"):
        Auto((None, Unknown()))


def test_auto_choice_is_logged_at_debug(caplog):
    """RINGCOMM_LOG_LEVEL=DEBUG (here: the logger's level) shows each choice of auto with the
    predicted cost of every candidate."""
    def job(t):
        comm = Communicator(t)
        comm.allreduce(np.ones(200_000, np.float32), compression="auto")
        return True

    with caplog.at_level(logging.DEBUG, logger="ringcomm.auto"):
        assert run_ranks(2, job) == [True, True]
    lines = [r.getMessage() for r in caplog.records if r.name == "ringcomm.auto"]
    assert lines, "no DEBUG record from ringcomm.auto"
    assert "800000 bytes over 2 ranks:" in lines[0] and "(predicted none " in lines[0], lines
