"""ringcomm's allreduce benchmark, in the style of nccl-tests' ``all_reduce_perf``.

Run under the launcher, one process per rank::

    mpiexec -n 2 ringcomm-perf -b 8 -e 128M -f 2
    mpiexec -n 2 python -m ringcomm.perf -b 4K -e 64M -f 4 --compression int8,topk:0.01

Columns follow nccl-tests: size (bytes per rank), count, type, redop, then out-of-place and
in-place time (us), algbw = size / time and busbw = algbw * 2(n-1)/n (GB/s) and #wrong (elements
off MPI's float64 reduction, or every element where a rank's result differs from rank 0's);
then ringcomm's own: the spread of the out-of-place time (interquartile range over median),
the relative error of compressed calls, the bytes this rank put on the wire and the
compression ratio against the dense ring, each baseline's time and busbw with ringcomm's
speed-up over it (MPI's own Allreduce by default; torch's gloo with ``--baseline gloo``;
NCCL's own allreduce on GPUs) and a single-process memcpy of the same size. Every figure is
the median over iterations of the slowest rank, all variants timed in turn within each
iteration. The run ends with nccl-tests' ``# Out of bounds values`` and ``# Avg bus
bandwidth`` lines, and warns first when the machine's load average says other work competes.

The exit status is 1 when a check found a wrong value, 0 otherwise.
"""

from __future__ import annotations

from ringcomm.perf.run import main

__all__ = ["main"]
