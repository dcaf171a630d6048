"""The allreduce benchmark that ships with the package (``ringcomm-perf``, ``python -m
ringcomm.perf``): its options, table and closing lines in one process, and a real run under
mpiexec from outside the source tree."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from ringcomm.perf import options, report


def test_variant_suffix_picks_the_algorithm():
    assert options.algorithm_kw("int8") == {}
    assert options.algorithm_kw("int8@hier") == {"algorithm": "hierarchical"}
    assert options.algorithm_kw("topk:0.01@flat") == {"algorithm": "flat"}
    assert options.parse_compression("none@hier") is None
    assert options.parse_compression("topk:0.01@hier").ratio == 0.01
    with pytest.raises(ValueError, match="unknown algorithm"):
        options.parse_compression("int8@ring")


def test_sizes_and_flags_as_nccl_tests_spells_them():
    args = options.parse_args(["-b", "8", "-e", "16M", "-f", "4", "-n", "3", "-w", "1",
                               "-c", "0", "-d", "half", "-o", "max"])
    assert (args.minbytes, args.maxbytes, args.stepfactor) == (8, 16 << 20, 4)
    assert (args.iters, args.warmup_iters, args.check, args.op) == (3, 1, 0, "max")
    assert options.sizes(args, 2) == [8 * 4 ** k for k in range(11)]
    assert options.dtype_of(args.datatype) == np.float16
    assert options.sizes(options.parse_args(["-b", "6", "-e", "6"]), 4) == [4]
    # Sizes below one element are one element, each once (two 4-byte rows before).
    assert options.sizes(options.parse_args(["-b", "1", "-e", "3"]), 4) == [4]


@pytest.mark.parametrize("argv, message", [
    (["-b", "1M", "-e", "4K"], "need 1 <= minbytes <= maxbytes"),
    (["-b", "0"], "need 1 <= minbytes"),  # the sizes never grew: a run without end
    (["-f", "1"], "stepfactor >= 2"),
    (["-b", "lots"], "expected a size like 8, 4K, 16M or 1G"),
    (["-w", "-3"], "-w/--warmup_iters must be >= 0, got -3"),
    (["--job-warmup", "-1"], "--job-warmup must be >= 0"),
    (["--phases", "-2"], "--phases must be >= 0"),
    (["-c", "5"], "-c/--check must be 0 or 1, got 5"),
    (["--compression", "int8,zip"], "unknown compression 'zip'"),
    (["--compression", "int8:abc"], "the block size in 'int8:abc' must be a whole number, "
                                    "got 'abc'"),
    (["--compression", "topk:x"], "the ratio in 'topk:x' must be a number, got 'x'"),
    (["--compression", "topk:2"], "ratio must be in (0, 1]"),
    (["--compression", "fp16:xyz"], "'fp16:xyz' is not of the form fp16"),
    (["--compression", "none:7"], "'none:7' is not of the form none"),
    (["--compression", "auto:foo"], "'auto:foo' is not of the form auto[:topk]"),
    (["--compression", "int8:1:2"], "'int8:1:2' is not of the form int8[:block]"),
    (["--compression", "int8,fp16,int8"], "--compression names int8 more than once"),
    (["--baseline", "mpi,foo"], "unknown baseline foo; known: mpi, gloo, nccl, none"),
    (["--backend", "tcp"], "invalid choice: 'tcp'"),
])
def test_bad_options_say_what_was_expected(argv, message):
    with pytest.raises(options.UsageError) as got:
        options.parse_args(argv)
    assert message in str(got.value)


def test_ranks_options_are_compared_but_rank_0s_output_files():
    one = options.agreed(options.parse_args(["-b", "8", "-e", "1M", "--json", "a.json"]))
    assert "json" not in one
    same = options.agreed(options.parse_args(["-b", "8", "-e", "1024K", "--json", "b.json"]))
    assert options.disagreement([(None, one), (None, same)]) is None
    other = options.agreed(options.parse_args(["-b", "8", "-e", "2M", "-n", "3"]))
    assert options.disagreement([(None, one), (None, other), (None, one)]) == (
        "-e/--maxbytes differs between ranks: 1048576 on ranks 0, 2; 2097152 on rank 1; "
        "-n/--iters differs between ranks: 20 on ranks 0, 2; 3 on rank 1")
    # A rank's problem comes first, with the ranks that have it.
    assert options.disagreement([(None, one), ("bad -f", None), ("bad -f", None)]) == (
        "ranks 1, 2: bad -f")
    # A rank with a bad option starts as the command line asks, where it can tell.
    assert options.start_options(["-f", "1", "--backend", "mpi", "--segment-bytes", "1M"]) == (
        "mpi", 1 << 20)
    assert options.start_options(["--backend", "tcp", "--segment-bytes", "lots"]) == (
        "auto", None)


def _row(size, label="none", **extra):
    row = {"size": size, "count": size // 4, "type": "float", "redop": "sum",
           "compression": label, "time_us": 10.0, "algbw": 1.0, "busbw": 2.0, "wrong": 0,
           "ip_time_us": 9.0, "ip_algbw": 1.1, "ip_busbw": 4.0, "ip_wrong": 0,
           "spread": 0.1, "wire_bytes": size, "ratio": 1.0}
    row.update(extra)
    return row


def test_table_has_nccl_tests_columns_and_ours():
    table = report.Table(["mpi"], in_place=True, memcpy=False)
    head = table.header().splitlines()
    assert "out-of-place" in head[0] and "in-place" in head[0]
    assert head[0].index("out-of-place") < head[0].index("in-place")
    names = head[1].split()
    assert names[:13] == ["#", "size", "count", "type", "redop", "compression", "time(us)",
                          "algbw", "busbw", "#wrong", "time(us)", "algbw", "busbw"][:13]
    assert {"iqr", "wire(B)", "mpi_time_us", "vs_mpi"} <= set(names)
    line = table.row(_row(1024, mpi_time_us=5.0, mpi_busbw=1.0, vs_mpi=0.5))
    assert len(line.split()) == len(names) - 1 and "10%" in line and " - " in line
    assert "in-place" not in report.Table([], in_place=False, memcpy=True).header()


def test_summary_averages_every_bus_bandwidth_per_variant():
    rows = [_row(8), _row(16), _row(8, "int8", busbw=6.0, ip_busbw=6.0, wrong=None,
                                     ip_wrong=None)]
    lines = report.summary(rows)
    assert lines[0] == "# Out of bounds values : 0 OK"
    assert lines[1] == "# Avg bus bandwidth (none)    : 3 GB/s"
    assert lines[2] == "# Avg bus bandwidth (int8)    : 6 GB/s"
    assert report.summary([_row(8), _row(16, ip_wrong=3)])[0] == \
        "# Out of bounds values : 3 FAILED"
    assert report.summary([_row(8)])[1] == "# Avg bus bandwidth    : 3 GB/s"


def test_load_warning_names_the_load(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    monkeypatch.setattr("os.getloadavg", lambda: (9.5, 1.0, 1.0))
    warning = report.load_warning(2)
    assert warning.startswith("# WARNING: load average 9.50 on 4 cores with 2 ranks")
    monkeypatch.setattr("os.getloadavg", lambda: (1.5, 1.0, 1.0))
    assert report.load_warning(2) is None


def _check_output(text: str, sizes: int) -> None:
    lines = text.splitlines()
    rows = [ln for ln in lines if ln and not ln.startswith("#")]
    assert len(rows) == sizes, text
    for row in rows:
        cols = row.split()
        assert cols[2:5] == ["float", "sum", "none"], row
        assert cols[8] == "0" and cols[12] == "0", row  # #wrong, out-of-place and in-place
    assert "# Out of bounds values : 0 OK" in lines, text
    assert re.search(r"^# Avg bus bandwidth    : [0-9.e+-]+ GB/s$", text, re.M), text


def _perf(mpiexec: str, env: dict[str, str], tmp_path, ranks: int,
          *args: str) -> tuple[str, list[dict]]:
    """``python -m ringcomm.perf`` under mpiexec, which must end well: its output and rows."""
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [mpiexec, "-n", str(ranks), sys.executable, "-m", "ringcomm.perf", *args,
         "--json", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())["rows"]


@pytest.mark.slow
def test_module_runs_under_mpiexec(mpiexec, subprocess_env, tmp_path):
    stdout, rows = _perf(mpiexec, subprocess_env, tmp_path, 2, "-b", "8", "-e", "64K",
                         "-f", "8", "-n", "3", "-w", "1")
    _check_output(stdout, 5)
    assert [r["size"] for r in rows] == [8, 64, 512, 4096, 32768]
    assert all(r["time_q1_us"] <= r["time_us"] <= r["time_q3_us"] for r in rows)


@pytest.mark.slow
def test_a_listed_dense_variant_leads_once_and_one_rank_has_no_bus(mpiexec, subprocess_env,
                                                                    tmp_path):
    """``--compression int8,none``: the dense ring is the ratios' reference, one row (it was
    printed twice, from one timing); at one rank busbw is 0, as nccl-tests' 2(n-1)/n says."""
    _, rows = _perf(mpiexec, subprocess_env, tmp_path, 1, "-b", "64K", "-e", "64K", "-n", "2",
                    "-w", "1", "--compression", "int8,none")
    assert [r["compression"] for r in rows] == ["none", "int8"]
    assert all(r["busbw"] == 0 and r["algbw"] > 0 for r in rows), rows


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", [
    (["-d", "int32", "-o", "avg"], "-d int32 -o avg --compression none: op 'avg' needs a "
                                   "floating dtype, got int32; use op='sum' and divide"),
    (["-o", "max", "--compression", "none,int8"],
     "-d float -o max --compression int8: compressed allreduce supports op 'sum' and 'avg', "
     "got 'max'"),
    (["--segment-bytes", "2G"], "--backend auto --segment-bytes 2147483648: segment_bytes must "
                                "be from 64 B to 1 GiB, got 2147483648"),
])
def test_what_ringcomm_refuses_is_told_once_with_status_2(mpiexec, subprocess_env, tmp_path,
                                                          argv, message):
    """Options each fine alone that ringcomm refuses together, or a segment it refuses: one
    line from rank 0 and exit status 2 on every rank, before any timing (each left a
    traceback on every rank and an MPI abort)."""
    proc = subprocess.run(
        [mpiexec, "-n", "2", sys.executable, "-m", "ringcomm.perf", "-b", "1K", "-e", "1K",
         "-n", "2", "-w", "1", *argv], cwd=tmp_path, env=subprocess_env, capture_output=True,
        text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == f"ringcomm-perf: error: {message}", proc.stderr
    assert "Traceback" not in proc.stdout and "size" not in proc.stdout, proc.stdout


PERF_SPY = """
import sys
import numpy as np
import ringcomm
from mpi4py import MPI
from ringcomm.perf import run

if sys.argv[1] == "differ":  # a compressed result off by one bit on rank 1
    real = ringcomm.Communicator.allreduce
    def allreduce(self, x, *args, **kwargs):
        y = real(self, x, *args, **kwargs)
        if kwargs.get("compression") is not None and MPI.COMM_WORLD.Get_rank() == 1:
            y.view(np.uint32).reshape(-1)[0] ^= 1
        return y
    ringcomm.Communicator.allreduce = allreduce
sys.exit(run.main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_options_of_one_rank_and_results_of_one_rank_are_told(mpiexec, subprocess_env,
                                                              tmp_path):
    """A bad option on one rank, options that differ between ranks, and a compressed result
    one bit off on one rank: told, with exit status 2 or 1, by every rank in seconds (a bad
    option left the other ranks waiting in MPI's start-up; options that differ, in
    mismatched calls without a timeout; the compressed result was not compared)."""
    spy = tmp_path / "spy.py"
    spy.write_text(PERF_SPY)

    def run(rank0: list[str], rank1: list[str], mode: str = "plain"):
        base = ["-b", "8", "-e", "8", "-n", "2", "-w", "1", "--job-warmup", "2"]
        cmd = [mpiexec, "-n", "1", sys.executable, str(spy), mode, *base, *rank0, ":",
               "-n", "1", sys.executable, str(spy), mode, *base, *rank1]
        return subprocess.run(cmd, cwd=tmp_path, env=subprocess_env, capture_output=True,
                              text=True, timeout=120)

    bad = run([], ["-f", "1"])
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "ringcomm-perf: error: rank 1: need 1 <= minbytes <= maxbytes, stepfactor >= 2" \
        in bad.stderr, bad.stderr
    differ = run(["-e", "64"], ["-e", "16"])
    assert differ.returncode == 2, differ.stdout + differ.stderr
    assert ("-e/--maxbytes differs between ranks: 64 on rank 0; 16 on rank 1"
            in differ.stderr), differ.stderr
    wrong = run(["--compression", "fp16"], ["--compression", "fp16"], "differ")
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    rows = [line.split() for line in wrong.stdout.splitlines()
            if line and not line.startswith("#")]
    assert [(row[4], row[8]) for row in rows] == [("none", "0"), ("fp16", "1")], wrong.stdout
    assert "# Out of bounds values : " in wrong.stdout and "FAILED" in wrong.stdout
