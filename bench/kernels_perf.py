"""Effective bandwidth of ringcomm's CUDA kernels against a device-to-device copy.

    .venv/bin/python bench/kernels_perf.py [-n 64M] [--iters 50] [--json out.json]

The ceiling is a device-to-device copy of the same number of elements. Every kernel is timed
with CUDA events around one launch (median of --iters runs after --warmup runs), cycling
through --rotate independent sets of inputs so that no run finds its data in L2; its effective
bandwidth is (bytes read + bytes written) / time. Top-k at --ratio of the elements is also
compared with torch.topk (when PyTorch sees the GPU) and a CuPy sort-based selection on the
same data. Needs CuPy and a CUDA GPU.

What the host does per call is shown next to the operations that are more than one launch
(in the kernel's name, and as fields of the JSON rows): ``launches`` through ringcomm's
launcher, ``allocs`` taken from CuPy's memory pool (after warm-up), and ``waits`` (1 when the
call returned only after the GPU had finished the work queued before it: a host
synchronization). Rows:

- select_hist, one radix-select histogram pass over all n keys, with warp-aggregated atomics
  and with plain ones, on gradient-like values and on mostly-zero ones (few distinct bins);
- top-k, exact (sampled prefilter, and the whole-array fallback on all-equal data) and DGC;
- sparse_residual in place (the sparse ring's residual) and into another array;
- the compressed rings' work on one rank (``ring ...``): rank 0 of an --ranks ring alone on
  the GPU, every message it sends coming back as the one it receives (same sizes: the
  bench's lengths divide evenly), so it does a ring rank's kernel work without peers (the
  values are not a reduction). Their bytes are the input read and the output written once.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import platform
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import ringcomm
from ringcomm import ops as array_ops
from ringcomm.algorithms import compressed_ring, ring
from ringcomm.algorithms import sparse as sparse_ring
from ringcomm.comm.transport import TransportBase
from ringcomm.core.types import RING, ReduceOp
from ringcomm.ops import _cuda_codecs, _cuda_runtime, _cuda_topk
from ringcomm.ops import numpy as host_ops

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_count(text: str) -> int:
    """'1000', '4K', '64M' -> elements."""
    m = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"expected a count like 4096, 4K or 64M, got {text!r}")
    return int(m.group(1)) * _SUFFIX[m.group(2)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--elements", type=parse_count, default=parse_count("64M"),
                   help="float32 elements per array (default 64M)")
    p.add_argument("--iters", type=int, default=50, help="timed runs per kernel")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs first")
    p.add_argument("--rotate", type=int, default=3, help="independent input sets cycled")
    p.add_argument("--block", type=int, default=256, help="int8 block size")
    p.add_argument("--ratio", type=float, default=0.01, help="top-k fraction")
    p.add_argument("--ranks", type=int, default=4, help="ring size of the ring rows")
    p.add_argument("--only", default="", help="comma list of kernel names to run")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    return p.parse_args(argv)


class Timer:
    """Median time of a GPU operation with CUDA events, inputs rotated between runs."""

    def __init__(self, cupy: Any, iters: int, warmup: int) -> None:
        self.cupy, self.iters, self.warmup = cupy, iters, warmup

    def median_us(self, run: Callable[[int], Any], events: Any = None) -> float:
        """Median microseconds of ``run(i)`` (i counts runs, for rotating inputs)."""
        make = events or (lambda: self.cupy.cuda.Event())
        for i in range(self.warmup):
            run(i)
        times = []
        for i in range(self.iters):
            start, end = make(), make()
            start.record()
            run(self.warmup + i)
            end.record()
            end.synchronize()
            elapsed = (start.elapsed_time(end) if hasattr(start, "elapsed_time")
                       else self.cupy.cuda.get_elapsed_time(start, end))
            times.append(elapsed * 1e3)
        return float(np.median(times))


class Work:
    """What the host does in one call: kernel launches through ringcomm's launcher, blocks
    taken from CuPy's memory pool, and whether it waited for the GPU.

    The wait is seen by queueing ``busy`` (copies that keep the GPU busy far longer than a
    call takes to enqueue) before the call: if an event recorded between the two has completed
    when the call returns, the call waited for the GPU.
    """

    def __init__(self, cupy: Any, busy: Callable[[], Any] | None = None) -> None:
        self.cupy, self.busy = cupy, busy

    def count(self, run: Callable[[], Any]) -> dict[str, int]:
        """{"launches", "allocs", "waits"} of one ``run()`` (waits only with ``busy``)."""
        launched = [0]

        def counting(launch: Callable[..., None], *a: Any, **kw: Any) -> None:
            launched[0] += 1
            launch(*a, **kw)

        hook = _pool_hook(self.cupy)
        stream = self.cupy.cuda.get_current_stream()
        if self.busy is not None:
            self.busy()
        before = stream.record()
        with launches_through(counting):
            with hook if hook is not None else contextlib.nullcontext():
                run()
            waited = bool(before.done) if self.busy is not None else None
        stream.synchronize()
        work = {"launches": launched[0]}
        if hook is not None:
            work["allocs"] = hook.count
        if waited is not None:
            work["waits"] = int(waited)
        return work


@contextlib.contextmanager
def launches_through(route: Callable[..., None]) -> Iterator[None]:
    """Meanwhile, every kernel launch of ringcomm's goes through ``route(launch, name, ...)``
    (``launch``: the real one), to be counted or timed."""
    launch = _cuda_runtime.launch
    _cuda_runtime.launch = functools.partial(route, launch)  # type: ignore[assignment]
    try:
        yield
    finally:
        _cuda_runtime.launch = launch  # type: ignore[assignment]


def breakdown(cupy: Any, run: Callable[[], Any]) -> tuple[float, list[tuple[str, int, float]]]:
    """Where one ``run()`` spends the GPU's time: the call's microseconds from first to last
    event, and per kernel name (launch order) its launches and their summed microseconds, each
    launch timed between events recorded around it. What the call's time exceeds the kernels'
    by is the GPU waiting for the host (launches, allocations, Python) or doing other work
    (copies, memsets)."""
    timed: list[tuple[str, Any, Any]] = []

    def timing(launch: Callable[..., None], name: str, *a: Any, **kw: Any) -> None:
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        launch(name, *a, **kw)
        end.record()
        timed.append((name, start, end))

    first, last = cupy.cuda.Event(), cupy.cuda.Event()
    with launches_through(timing):
        first.record()
        run()
        last.record()
    last.synchronize()
    us: dict[str, list[float]] = {}
    for name, start, end in timed:
        us.setdefault(name, []).append(cupy.cuda.get_elapsed_time(start, end) * 1e3)
    total = cupy.cuda.get_elapsed_time(first, last) * 1e3
    return total, [(name, len(v), float(sum(v))) for name, v in us.items()]


def _pool_hook(cupy: Any) -> Any:
    """A CuPy MemoryHook counting the pool's allocations (None where CuPy has none)."""
    base = getattr(getattr(cupy.cuda, "memory_hook", None), "MemoryHook", None)
    if base is None:
        return None

    class Counting(base):  # type: ignore[misc, valid-type]
        name = "ringcomm-bench-count"

        def __init__(self) -> None:
            self.count = 0

        def malloc_preprocess(self, **kwargs: Any) -> None:
            self.count += 1

    return Counting()


class _Done:
    def wait(self) -> None:
        pass


class Loopback(TransportBase):
    """Rank 0 of a ring of ``size`` alone on one GPU: each message it sends comes back as the
    one it receives (a copy on the current stream), so it does a ring rank's kernel work
    without peers. The sizes match when the length divides evenly into the segments; the
    values are not a reduction."""

    backend = "loopback"

    def __init__(self, size: int) -> None:
        super().__init__(0, size)

    def isendrecv(self, send: Any | None, dest: int, recv: Any | None, source: int, *,
                  channel: int = RING) -> _Done:
        if send is not None and recv is not None:
            m = min(send.size, recv.size)
            array_ops.get(recv).copy(recv.reshape(-1)[:m], send.reshape(-1)[:m])
        return _Done()


def knob(module: Any, name: str, value: Any, run: Callable[[int], Any]) -> Callable[[int], Any]:
    """``run`` with ``module.name`` set to ``value`` for each call (a variant measured beside
    the default in the same run)."""

    def wrapped(i: int) -> Any:
        kept = getattr(module, name)
        setattr(module, name, value)
        try:
            return run(i)
        finally:
            setattr(module, name, kept)

    return wrapped


def ring_rows(cupy: Any, n: int, ranks: int, ratio: float,
              segment_bytes: int = ring.DEFAULT_SEGMENT_BYTES) -> list[tuple[str, int, Callable]]:
    """(name, bytes, run(i)) of the compressed rings' work on one rank of ``ranks``."""
    n -= n % (ranks * 4096)  # equal chunks and segments: every looped-back size matches
    rng = np.random.default_rng(2)
    x = cupy.asarray(rng.standard_normal(n, dtype=np.float32))
    h = x.astype(np.float16)
    out, out16 = cupy.empty_like(x), cupy.empty_like(h)
    residual = cupy.zeros_like(x)
    t = Loopback(ranks)
    int8, fp16 = ringcomm.Int8(), ringcomm.FP16()
    topk = ringcomm.TopK(ratio)
    sum_, avg = ReduceOp.SUM, ReduceOp.AVG

    def dense(comp: Any, src: Any, dst: Any, op: ReduceOp, res: Any) -> Callable[[int], None]:
        return lambda i: compressed_ring.allreduce(t, src, dst, op, comp, res, i,
                                                   segment_bytes=segment_bytes)

    dense_rows = [
        (f"ring int8 +feedback n={ranks}", 8 * n, dense(int8, x, out, sum_, residual)),
        (f"ring int8 n={ranks}", 8 * n, dense(int8, x, out, sum_, None)),
        (f"ring fp16 avg of fp16 n={ranks}", 4 * n, dense(fp16, h, out16, avg, None)),
    ]
    # The same rings cut as on the host (segment_bytes alone: dozens of segments a chunk).
    host_cut = [(f"{name} host segments", nbytes, knob(ring, "DEVICE_SEGMENTS", 0, run))
                for name, nbytes, run in dense_rows]
    return [*dense_rows, *host_cut,
            (f"ring topk +feedback n={ranks}", 8 * n,
             lambda i: sparse_ring.ring_allreduce(t, x, out, sum_, topk, residual, i))]


def _inputs(cupy: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """--rotate independent sets of every kernel's inputs and outputs."""
    n, block = args.elements, args.block
    rng = np.random.default_rng(0)  # on the host: cuRAND is not among the test extra's wheels
    sets = []
    for _ in range(args.rotate):
        x = cupy.asarray(rng.standard_normal(n, dtype=np.float32))
        own = cupy.asarray(rng.standard_normal(n, dtype=np.float32))
        s = {"x": x, "own": own, "out": cupy.empty(n, np.float32),
             "err": cupy.empty(n, np.float32), "h": x.astype(np.float16),
             "q": cupy.empty(host_ops.int8_nbytes(n, block), np.uint8),
             "q2": cupy.empty(host_ops.int8_nbytes(n, block), np.uint8),
             "w": cupy.empty(host_ops.cast_nbytes(n), np.uint8),
             "w2": cupy.empty(host_ops.cast_nbytes(n), np.uint8)}
        sets.append(s)
    return sets


def _shaped(cupy: Any, n: int) -> dict[str, Any]:
    """Inputs whose value distribution matters: gradient-like values (normal, log-normal
    scales), a mostly-zero array (1% non-zero: a handful of histogram bins), and one of equal
    magnitudes (top-k's whole-array fallback)."""
    rng = np.random.default_rng(3)
    grads = rng.standard_normal(n, dtype=np.float32)
    grads *= rng.lognormal(0, 1, n).astype(np.float32)
    sparse = cupy.zeros(n, np.float32)
    hot = cupy.asarray(rng.choice(n, size=max(1, n // 100), replace=False))
    sparse[hot] = cupy.asarray(rng.standard_normal(hot.size, dtype=np.float32))
    return {"grads": cupy.asarray(grads), "sparse": sparse,
            "equal": cupy.full(n, 0.5, np.float32)}


def _hist_pass(cupy: Any, x: Any, aggregate: bool) -> Callable[[int], None]:
    """One select_hist pass (the first: 11 bits, every key) over x, as top-k launches it."""
    state = cupy.zeros(8, np.uint32)
    hist = cupy.zeros(2048, np.uint32)  # left to add up: the counts do not matter here
    blocks = _cuda_runtime.grid(-(-x.size // 4))
    null = _cuda_runtime.NULL
    args = (x, np.int64(0), np.int64(1), np.int64(x.size), null, null, state, np.int32(20),
            np.int32(11), np.int32(1), hist, np.int32(1), np.int32(aggregate), np.int64(1),
            null)
    return lambda i: _cuda_runtime.launch("rc::select_hist", blocks, args)


def _kernels(cupy: Any, args: argparse.Namespace, sets: list[dict[str, Any]],
             shaped: dict[str, Any]) -> list[tuple[str, int, Callable[[int], Any], bool]]:
    """(name, bytes read + written, run(i), whether to count its host work) of each
    benchmarked operation."""
    from ringcomm.ops import cuda as ops

    n, block = args.elements, args.block
    nb = -(-n // block)
    q_bytes = n + 4 * nb
    k = max(1, math.ceil(args.ratio * n))
    picked = np.random.default_rng(1).choice(n, size=k, replace=False)  # unique, as in payloads
    idx = cupy.asarray(np.sort(picked).astype(np.int32))

    def pick(i: int) -> dict[str, Any]:
        return sets[i % len(sets)]

    stoch = {"stochastic": True, "seed": 7, "base": 0}
    grads, equal = shaped["grads"], shaped["equal"]
    rows: list[tuple[str, int, Callable[[int], Any], bool]] = [
        ("reduce f32+f32", 12 * n, lambda i: ops.reduce(ReduceOp.SUM, pick(i)["x"],
                                                         pick(i)["own"], pick(i)["out"]), False),
        ("reduce f32+f16->f32", 10 * n, lambda i: ops.reduce(ReduceOp.SUM, pick(i)["own"],
                                                              pick(i)["h"], pick(i)["out"]),
         False),
        ("copy f32->f16", 6 * n, lambda i: ops.copy(pick(i)["h"], pick(i)["x"]), False),
        ("compensate", 12 * n, lambda i: ops.compensate(pick(i)["x"], pick(i)["own"],
                                                         pick(i)["out"]), False),
        ("int8 quantize", 4 * n + q_bytes,
         lambda i: ops.int8_encode(pick(i)["x"], pick(i)["q"], block), False),
        ("int8 quantize+error", 8 * n + q_bytes,
         lambda i: ops.int8_encode(pick(i)["x"], pick(i)["q"], block, error=pick(i)["err"]),
         False),
        ("int8 quantize stoch+error", 8 * n + q_bytes,
         lambda i: ops.int8_encode(pick(i)["x"], pick(i)["q"], block, error=pick(i)["err"],
                                   **stoch), False),
        ("int8 dequantize", q_bytes + 4 * n,
         lambda i: ops.int8_decode(pick(i)["q"], pick(i)["out"], block), False),
        ("int8 fused hop+error", 2 * q_bytes + 8 * n,
         lambda i: ops.int8_hop(pick(i)["q"], pick(i)["own"], pick(i)["q2"], block,
                                error=pick(i)["err"]), False),
        ("fp16 encode+error", 10 * n,
         lambda i: ops.cast_encode(pick(i)["x"], pick(i)["w"], "f16", error=pick(i)["err"]),
         False),
        ("bf16 hop+error", 12 * n,
         lambda i: ops.cast_hop(pick(i)["w"], pick(i)["own"], pick(i)["w2"], "bf16",
                                error=pick(i)["err"]), False),
    ]
    for lanes in (1, 2):  # the default is _cuda_codecs.RUNS_PER_LANE (4)
        rows += [
            (f"int8 quantize [{lanes} run/lane]", 4 * n + q_bytes,
             knob(_cuda_codecs, "RUNS_PER_LANE", lanes,
                  lambda i: ops.int8_encode(pick(i)["x"], pick(i)["q"], block)), False),
            (f"int8 fused hop+error [{lanes} run/lane]", 2 * q_bytes + 8 * n,
             knob(_cuda_codecs, "RUNS_PER_LANE", lanes,
                  lambda i: ops.int8_hop(pick(i)["q"], pick(i)["own"], pick(i)["q2"], block,
                                         error=pick(i)["err"])), False),
        ]
    rows += [
        (f"scatter_add k={k}", 16 * k,
         lambda i: ops.scatter_add(pick(i)["out"], idx, pick(i)["own"][:k]), False),
        (f"sparse_residual in place k={k}", 4 * n + 8 * k,
         lambda i: ops.sparse_residual(pick(i)["err"], idx, pick(i)["err"]), True),
        (f"sparse_residual copy k={k}", 8 * n + 8 * k,
         lambda i: ops.sparse_residual(pick(i)["x"], idx, pick(i)["err"]), True),
    ]
    for data in ("grads", "sparse"):
        for aggregate in (True, False):
            how = "warp-aggregated" if aggregate else "plain atomics"
            rows.append((f"select_hist {data} {how}", 4 * n,
                         _hist_pass(cupy, shaped[data], aggregate), False))
    rows += [
        (f"topk exact k={k}", 4 * n + 8 * k, lambda i: ops.topk(pick(i)["x"], k), True),
        (f"topk exact gradients k={k}", 4 * n + 8 * k, lambda i: ops.topk(grads, k), True),
        (f"topk exact all-equal (whole-array select) k={k}", 4 * n + 8 * k,
         lambda i: ops.topk(equal, k), True),
        (f"topk approximate k={k}", 4 * n + 8 * k,
         lambda i: ops.topk(pick(i)["x"], k, approximate=True, seed=i), True),
        (f"topk exact, counted in one wave k={k}", 4 * n + 8 * k,
         knob(_cuda_topk, "COUNT_WAVE", True, lambda i: ops.topk(pick(i)["x"], k)), True),
        (f"topk exact, counted then written in two passes k={k}", 4 * n + 8 * k,
         knob(_cuda_topk, "SINGLE_PASS", False, lambda i: ops.topk(pick(i)["x"], k)), True),
        (f"topk exact gradients, counted then written in two passes k={k}", 4 * n + 8 * k,
         knob(_cuda_topk, "SINGLE_PASS", False, lambda i: ops.topk(grads, k)), True),
        (f"topk exact, digits picked by select_pick k={k}", 4 * n + 8 * k,
         knob(_cuda_topk, "FUSED_PICK", False, lambda i: ops.topk(pick(i)["x"], k)), True),
        (f"topk exact, two passes and digits picked by select_pick k={k}", 4 * n + 8 * k,
         knob(_cuda_topk, "FUSED_PICK", False,
              knob(_cuda_topk, "SINGLE_PASS", False, lambda i: ops.topk(pick(i)["x"], k))),
         True),
        (f"topk approximate, digits picked by select_pick k={k}", 4 * n + 8 * k,
         knob(_cuda_topk, "FUSED_PICK", False,
              lambda i: ops.topk(pick(i)["x"], k, approximate=True, seed=i)), True),
    ]
    return rows + [(*row, True) for row in ring_rows(cupy, n, args.ranks, args.ratio)]


def _topk_baselines(cupy: Any, args: argparse.Namespace, sets: list[dict[str, Any]],
                    timer: Timer) -> list[tuple[str, float]]:
    """torch.topk and a CuPy sort-based selection of the same k on the same data."""
    n = args.elements
    k = max(1, math.ceil(args.ratio * n))
    rows = []

    def sort_select(i: int) -> Any:
        order = cupy.argsort(cupy.abs(sets[i % len(sets)]["x"]))
        return cupy.sort(order[n - k:])  # ascending indices, as ringcomm returns them

    rows.append((f"cupy argsort select k={k}", timer.median_us(sort_select)))
    try:
        import torch
    except ImportError:
        return rows
    if not torch.cuda.is_available():
        return rows
    tensors = [torch.from_dlpack(s["x"]) for s in sets]

    def torch_topk(i: int) -> Any:
        return torch.topk(tensors[i % len(tensors)].abs(), k, sorted=False)

    rows.append((f"torch.topk k={k}", timer.median_us(torch_topk,
                                                      lambda: torch.cuda.Event(True))))
    return rows


#: The rows whose kernels are timed one by one as well (top-k, the int8 and top-k rings).
BREAKDOWN = ("topk exact", "topk approximate", "ring int8 n=", "ring topk")


def _breakdown_rows(cupy: Any, name: str, run: Callable[[int], Any]) -> list[dict[str, Any]]:
    """Rows "<name> / <kernel> xN" with the kernels' summed time in one call, and one for what
    the call took beyond them."""
    total, kernels = breakdown(cupy, lambda: run(0))
    short = name.split(" k=")[0]
    rows = [{"kernel": f"  {short} / {kernel} x{count}", "bytes": None,
             "us": us, "gbps": None, "of_copy": None} for kernel, count, us in kernels]
    rows.append({"kernel": f"  {short} / beyond its kernels (host, copies)",
                 "bytes": None, "us": total - sum(r["us"] for r in rows), "gbps": None,
                 "of_copy": None})
    enqueue = []
    for _ in range(5):  # the host's own time to enqueue the call (it never waits: see Work)
        cupy.cuda.get_current_stream().synchronize()
        began = time.perf_counter()
        run(0)
        enqueue.append((time.perf_counter() - began) * 1e6)
    rows.append({"kernel": f"  {short} / host enqueue", "bytes": None,
                 "us": float(np.median(enqueue)), "gbps": None, "of_copy": None})
    return rows


def _device(cupy: Any) -> dict[str, Any]:
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return {"name": name, "compute_capability": dev.compute_capability,
            "memory_bytes": int(props["totalGlobalMem"]), "sms": int(props["multiProcessorCount"]),
            "cupy": cupy.__version__, "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "host": platform.node()}


def _label(name: str, work: dict[str, int] | None) -> str:
    if not work:
        return name
    return f"{name} [" + ", ".join(f"{v} {k}" for k, v in work.items()) + "]"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception as err:
        print(f"kernels_perf needs CuPy and a CUDA GPU ({err})", file=sys.stderr)
        return 2
    timer = Timer(cupy, args.iters, args.warmup)
    sets = _inputs(cupy, args)
    n = args.elements

    def copy(i: int) -> None:
        s = sets[i % len(sets)]
        s["out"].data.copy_from_device(s["x"].data, 4 * n)

    copy_us = timer.median_us(copy)
    ceiling = 8 * n / copy_us / 1e3
    rows = [{"kernel": "d2d copy f32 (ceiling)", "bytes": 8 * n, "us": copy_us,
             "gbps": ceiling, "of_copy": 1.0}]
    stream = cupy.cuda.get_current_stream()

    def busy() -> None:  # about 50 ms of copies: far longer than enqueueing any call
        for i in range(max(1, math.ceil(50_000 / copy_us))):
            s = sets[i % len(sets)]
            s["out"].data.copy_from_device_async(s["x"].data, 4 * n, stream)

    work = Work(cupy, busy)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    for name, nbytes, run, counted in _kernels(cupy, args, sets, _shaped(cupy, n)):
        if only and name.split(" k=")[0].split(" n=")[0] not in only:
            continue
        us = timer.median_us(run)
        row = {"kernel": name, "bytes": nbytes, "us": us, "gbps": nbytes / us / 1e3,
               "of_copy": nbytes / us / 1e3 / ceiling}
        if counted:  # after the timed runs: nothing left to compile or to grow
            row.update(work.count(lambda run=run: run(0)))
        rows.append(row)
        if counted and name.startswith(BREAKDOWN):
            rows += _breakdown_rows(cupy, name, run)
    baselines = [] if only else _topk_baselines(cupy, args, sets, timer)
    for name, us in baselines:
        rows.append({"kernel": name, "bytes": None, "us": us, "gbps": None, "of_copy": None})
    for row in rows:
        counts = {k: row[k] for k in ("launches", "allocs", "waits") if k in row}
        row["kernel"] = _label(row["kernel"], counts)
    device = _device(cupy)
    print(f"# {device['name']} (sm_{''.join(map(str, device['compute_capability']))}), "
          f"{n} float32 elements, median of {args.iters} runs")
    width = max(34, 2 + max(len(r["kernel"]) for r in rows))
    print(f"{'kernel':<{width}}{'bytes':>14}{'time (us)':>12}{'GB/s':>9}{'of copy':>9}")
    for r in rows:
        gbps = f"{r['gbps']:9.1f}" if r["gbps"] is not None else f"{'-':>9}"
        frac = f"{r['of_copy']:9.0%}" if r["of_copy"] is not None else f"{'-':>9}"
        nbytes = f"{r['bytes']:14d}" if r["bytes"] is not None else f"{'-':>14}"
        print(f"{r['kernel']:<{width}}{nbytes}{r['us']:12.1f}{gbps}{frac}")
    if args.json:
        args.json.write_text(json.dumps({"device": device, "elements": n, "block": args.block,
                                         "ratio": args.ratio, "iters": args.iters,
                                         "ranks": args.ranks, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
