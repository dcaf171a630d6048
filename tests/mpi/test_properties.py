"""Property: every collective returns bit-identical results on every rank, or raises the same
exception (type and message) on every rank; and the next call still works.

Hypothesis draws a call: the collective (allreduce, reduce_scatter, allgather, allgatherv,
broadcast), shape (zero-size, scalar, below and above the inline size, up to 90,000
elements), dtype, byte order, memory layout (strided, Fortran, negative strides, unaligned,
ndarray subclass, memmap), op, root, ``out`` (none, in place, another layout), compression
(FP16, BF16, Int8, TopK, "auto"), error feedback and name, ring segment size, and NaN/Inf now
and then. Then up to two perturbations on drawn ranks: another shape, dtype, byte order, op,
root, compression, feedback, name, segment size or collective; an invalid ``out`` (wrong shape
or dtype, read-only, overlapping ``x``, a list), a read-only ``x``, a list for ``x``, a stale
residual; or a legal change (layout, another valid ``out``, op or root spelled otherwise).

A small model of ringcomm's rules predicts whether every rank must return or every rank must
raise, and which CollectiveError naming which ranks or fields. Each example then checks,
across ranks:

- every rank drew the same example (a divergence fails, it does not hang);
- the same outcome everywhere: the same result bytes, or the same exception type and message,
  as predicted; results have the input's shape and dtype, ``out`` is what is returned, ``x`` is
  left alone unless it is ``out``, a call that raised changed no residual; where every rank's
  call was valid and matching, the result equals a NumPy reference computed from every rank's
  input (exact for integers, min/max, gathers and broadcasts; floats within rounding, NaN and
  Inf kept), and error feedback conserves the sum;
- a small inline allreduce and a ring allreduce afterwards return the right values.

Under MPI every rank must run the same examples in the same order: generation is derandomized,
with no database and no shrinking, and every check is exchanged over a duplicate of
MPI.COMM_WORLD before it fails, so that all ranks fail the same example the same way.
"""

from __future__ import annotations

import hashlib
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import ringcomm
from ringcomm.algorithms.ring import DEFAULT_SEGMENT_BYTES

try:
    import ml_dtypes
except ImportError:  # bfloat16 is then left out
    ml_dtypes = None

SIZE = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()

FLOATS = ("float16", "float32", "float64") + (("bfloat16",) if ml_dtypes else ())
INTS = ("int32", "int64")
REDUCIBLE = FLOATS + INTS
MOVABLE_ONLY = ("int8", "uint8", "int16", "uint32", "bool", "complex64")
OPS = ("sum", "avg", "min", "max", "prod")
KINDS = ("allreduce", "reduce_scatter", "allgather", "allgatherv", "broadcast")
LAYOUTS = ("contiguous", "strided", "fortran", "reversed", "unaligned", "subclass", "memmap")
# Valid ``out``s of an allreduce: none, x itself, another view of x's elements, or a separate
# array in any memory layout.
OUTS_LEGAL = ("none", "inplace", "alias", *LAYOUTS)
COMPRESSIONS: dict[str, Callable[[], Any]] = {
    "fp16": ringcomm.FP16,
    "bf16": ringcomm.BF16,
    "int8": ringcomm.Int8,
    "int8-b64-stochastic": lambda: ringcomm.Int8(block_size=64, stochastic=True, seed=3),
    "topk": lambda: ringcomm.TopK(0.1),
    "topk-allgather": lambda: ringcomm.TopK(0.25, algorithm="allgather"),
    "topk-approximate": lambda: ringcomm.TopK(0.05, approximate=True),
    "topk-all": lambda: ringcomm.TopK(1.0),
    "auto": lambda: "auto",
    "auto-topk": lambda: ringcomm.Auto((None, ringcomm.FP16(), ringcomm.Int8(),
                                        ringcomm.TopK(0.01))),
}
# Compressions whose one-call error is bounded (all but those that drop top-k entries).
BOUNDED = ("fp16", "bf16", "int8", "int8-b64-stochastic", "auto", "topk-all")
# Not drawn for every rank: refused (a string other than "auto" is no compressor).
NOT_A_COMPRESSOR = "int8-as-a-string"
# Ring segment sizes (0: the communicator's own); some are no multiple of any itemsize.
SEGMENTS = (0, 0, 0, 8192, 65536, 1001, 4097)
# Special values sprinkled into floating inputs now and then (1e4: finite in every dtype,
# and its sum over three ranks too).
SPECIALS = (np.nan, np.inf, -np.inf, -0.0, 1e4)
SWAPPED = ">" if sys.byteorder == "little" else "<"

# Examples per test: about 3 s at 2 ranks and 10 s at 3 ranks (oversubscribed) on 2 cores.
EXAMPLES = 300
SETTINGS = {
    "derandomize": True,
    "database": None,
    "deadline": None,
    "phases": [Phase.explicit, Phase.generate],
    "suppress_health_check": list(HealthCheck),
    "report_multiple_bugs": False,
    "print_blob": False,
}


# NaN and Inf inputs make NumPy warn inside ringcomm's arithmetic (inf - inf): expected here.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


class Sub(np.ndarray):
    """A trivial ndarray subclass."""


# --------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Call:
    """What one rank passes to a collective, and how its arrays are laid out in memory."""

    kind: str
    shape: tuple[int, ...]
    dtype: str
    swapped: bool = False
    layout: str = "contiguous"
    op: str = "sum"
    spelling: str = "plain"  # how op and root are passed: plain, or "SUM", ReduceOp, np.int64
    root: int = 0
    out: str = "none"
    compression: str = "none"
    feedback: bool = False
    name: str | None = None
    as_list: bool = False
    readonly_x: bool = False
    stale_residual: bool = False
    segment_bytes: int = 0

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def reduces(self) -> bool:
        return self.kind in ("allreduce", "reduce_scatter")


@dataclass(frozen=True)
class Case:
    """A drawn example: the call every rank makes, one rank's perturbation of it, and now and
    then a second perturbation on the next rank (on the same one at size 1)."""

    call: Call
    perturbation: str
    victim: int
    alt: int
    seed: int
    repeat: bool
    special: bool = False
    perturbation2: str = "none"

    def call_on(self, rank: int) -> Call:
        c = self.call
        if rank == self.victim % SIZE:
            c = perturb(c, self.perturbation, self.alt)
        if rank == (self.victim + 1) % SIZE:
            c = perturb(c, self.perturbation2, self.alt // 2)
        return c

    def describe(self) -> str:
        text = f"perturbation {self.perturbation!r} on rank {self.victim % SIZE}"
        if self.perturbation2 != "none":
            text += f", {self.perturbation2!r} on rank {(self.victim + 1) % SIZE}"
        return text


def _other(options: tuple[Any, ...], current: Any, alt: int) -> Any:
    """An option other than ``current`` (``current`` itself if there is none)."""
    rest = [o for o in options if o != current]
    return rest[alt % len(rest)] if rest else current


def perturb(c: Call, how: str, alt: int) -> Call:
    """``c`` as the perturbed rank calls it."""
    if how == "none":
        return c
    if how == "layout":
        return replace(c, layout=_other(LAYOUTS, c.layout, alt))
    if how == "shape":
        return replace(c, shape=(c.shape[0] + 1, *c.shape[1:]) if c.shape else (1,))
    if how == "reshape":
        return replace(c, shape=(c.size,) if len(c.shape) != 1 else (c.size, 1))
    if how == "dtype":
        pool = REDUCIBLE if c.dtype in REDUCIBLE else MOVABLE_ONLY
        return replace(c, dtype=_other(pool, c.dtype, alt))
    if how == "byteorder":
        return replace(c, swapped=not c.swapped)
    if how == "op":
        return replace(c, op=_other(OPS, c.op, alt))
    if how == "bad_op":
        return replace(c, op="median")
    if how == "root":
        return replace(c, root=(c.root + 1) % SIZE)
    if how == "bad_root":
        return replace(c, root=(SIZE, -1)[alt % 2])
    if how == "spelling":
        return replace(c, spelling="other")
    if how == "compression":
        options = ("none", *COMPRESSIONS, NOT_A_COMPRESSOR)
        return replace(c, compression=_other(options, c.compression, alt))
    if how == "feedback":
        return replace(c, feedback=not c.feedback)
    if how == "name":
        return replace(c, name=None if c.name and alt % 3 == 0 else f"{c.name}-other")
    if how == "stale_residual":
        return replace(c, stale_residual=True)
    if how == "out_legal":
        return replace(c, out=_other(OUTS_LEGAL, c.out, alt))
    if how in ("out_shape", "out_dtype", "out_readonly", "out_overlap", "out_list"):
        return replace(c, out=how[4:], layout="contiguous")
    if how == "list":
        return replace(c, as_list=True)
    if how == "readonly_x":
        return replace(c, readonly_x=True)
    if how == "segment_bytes":
        used = {c.segment_bytes or DEFAULT_SEGMENT_BYTES}
        return replace(c, segment_bytes=next(s for s in (4096, 16384, 1 << 20) if s not in used))
    if how == "kind":
        kind = _other((*KINDS, "barrier"), c.kind, alt)
        return replace(c, kind=kind, compression="none", feedback=False, out="none",
                       op="sum" if kind == "reduce_scatter" and c.op == "avg" else c.op)
    raise AssertionError(f"unknown perturbation {how!r}")


def invalid(c: Call) -> bool:
    """Whether ringcomm refuses ``c`` on the rank that makes it."""
    if c.kind == "barrier":
        return False
    if c.as_list:
        return True
    if c.kind in ("allgather", "allgatherv"):
        return len(c.shape) == 0
    if c.kind == "broadcast":
        return c.readonly_x or not 0 <= c.root < SIZE
    if c.swapped or c.dtype not in REDUCIBLE or c.op not in OPS:
        return True
    if c.op == "avg" and c.dtype in INTS:
        return True
    if c.kind == "reduce_scatter":
        return False
    if c.out in ("shape", "dtype", "readonly", "list") or (
            c.out in ("inplace", "alias") and c.readonly_x):
        return True
    if c.out == "overlap" and c.size >= 2:
        return True
    if c.compression != "none":
        if c.compression == NOT_A_COMPRESSOR or c.dtype not in FLOATS or c.op not in ("sum", "avg"):
            return True
        return c.feedback and (not c.name or c.stale_residual)
    return c.feedback


def compression_key(c: Call) -> tuple[Any, ...] | None:
    """What the agreement compares of a compressed call (None when uncompressed)."""
    if c.kind != "allreduce" or c.compression == "none":
        return None
    return (c.compression, c.name, c.feedback)


@dataclass(frozen=True)
class Prediction:
    """What every rank must see: "ok", "error" (of class ``error``) or "either".

    For an InvalidArgumentError, ``ranks`` are the ranks whose call is invalid (the error
    names some of them); for an ArgumentMismatchError, ``fields`` are the fields that differ
    (``err.differences`` holds them, and may hold those in ``maybe`` too).
    """

    outcome: str
    error: type[Exception] | None = None
    why: str = ""
    ranks: tuple[int, ...] = ()
    fields: frozenset[str] = frozenset()
    maybe: frozenset[str] = frozenset()


def differing(calls: list[Call]) -> frozenset[str]:
    """The fields of the agreement's error message that differ between ``calls``."""
    kind = calls[0].kind
    shape = "shape after the first dimension" if kind == "allgatherv" else "shape"
    fields = {
        "dtype": lambda c: (c.dtype, c.swapped),
        shape: lambda c: (len(c.shape), c.shape[1:]) if kind == "allgatherv" else c.shape,
        "op": lambda c: c.op if c.reduces else "",
        "root": lambda c: c.root if kind == "broadcast" else 0,
        "compression/name": compression_key,
        "segment_bytes": lambda c: c.segment_bytes or DEFAULT_SEGMENT_BYTES,
    }
    return frozenset(f for f, key in fields.items() if len({key(c) for c in calls}) > 1)


def predict(calls: list[Call]) -> Prediction:
    """The outcome ringcomm promises when rank r makes ``calls[r]``."""
    if len({c.kind for c in calls}) > 1:
        return Prediction("error", ringcomm.ArgumentMismatchError, "collectives differ",
                          fields=frozenset({"kind"}))
    bad = tuple(r for r, c in enumerate(calls) if invalid(c))
    if bad:
        return Prediction("error", ringcomm.InvalidArgumentError, f"invalid on ranks {bad}",
                          ranks=bad)
    fields = differing(calls)
    auto = any(c.compression.startswith("auto") for c in calls)
    # "auto" agrees on its choice once it has figures: the choice may match another rank's
    # compressor, or be dense (then name and feedback are not compared), or differ where the
    # array does.
    maybe = frozenset({"compression/name"}) if auto else frozenset()
    if fields - maybe:
        cls = (ringcomm.DtypeMismatchError if "dtype" in fields
               else ringcomm.ArgumentMismatchError)
        return Prediction("error", cls, "arguments differ", fields=fields - maybe, maybe=maybe)
    if fields:
        return Prediction("either", why="auto against another compression/name/feedback",
                          maybe=maybe)
    return Prediction("ok")


def error_problems(err: Exception, calls: list[Call], expected: Prediction) -> list[str]:
    """What is wrong with ``err``, raised where ``expected`` was predicted."""
    if not isinstance(err, ringcomm.CollectiveError):
        return [f"untyped error {type(err).__name__}: {err}"]
    problems = []
    if expected.error is not None and not isinstance(err, expected.error):
        problems.append(f"raised {type(err).__name__}, expected a {expected.error.__name__} "
                        f"({expected.why}): {err}")
    if err.kind != "/".join(dict.fromkeys(c.kind for c in calls)):
        problems.append(f"err.kind is {err.kind!r}: {err}")
    if expected.ranks and not (err.ranks and set(err.ranks) <= set(expected.ranks)):
        problems.append(f"err.ranks {err.ranks}, expected some of {expected.ranks}: {err}")
    if expected.fields and not (
            expected.fields <= set(err.differences) <= expected.fields | expected.maybe):
        problems.append(f"err.differences names {sorted(err.differences)}, expected "
                        f"{sorted(expected.fields)}: {err}")
    return problems


# ------------------------------------------------------------------------------ strategies
@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, ...]:
    """Shapes of 0 to 3 dimensions: zero-size, a few elements, up to 4 KiB (the inline path
    in most dtypes) and over 4 KiB in every dtype (the ring), up to 90,000 elements."""
    where = draw(st.sampled_from(("ring", "inline", "ring", "few", "zero", "inline", "scalar",
                                  "edge")))
    if where == "zero":
        return draw(st.sampled_from([(0,), (0, 5), (3, 0), (2, 0, 4)]))
    if where == "scalar":
        return ()
    if where == "edge":  # 4 KiB (inline_bytes by default) give or take one element
        n = draw(st.sampled_from((511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049)))
    else:
        low, high = {"few": (1, 8), "inline": (9, 1000), "ring": (2049, 90_000)}[where]
        n = draw(st.integers(low, high))
    ndim = draw(st.integers(1, 3))
    if ndim == 1:
        return (n,)
    k = draw(st.integers(1, 6))
    first = max(n // k, 1)
    return (first, k) if ndim == 2 else (max(first // 2, 1), 2, k)


DENSE_PERTURBATIONS = (
    "layout", "shape", "reshape", "dtype", "byteorder", "op", "bad_op", "out_legal",
    "out_shape", "out_dtype", "out_readonly", "out_overlap", "out_list", "list", "readonly_x",
    "segment_bytes", "kind", "feedback", "name", "spelling")
COMPRESSED_PERTURBATIONS = (
    "layout", "compression", "compression", "feedback", "name", "stale_residual", "op",
    "dtype", "shape", "out_legal", "list", "segment_bytes")
GATHER_PERTURBATIONS = (
    "layout", "shape", "reshape", "dtype", "byteorder", "op", "root", "bad_root", "list",
    "readonly_x", "segment_bytes", "kind", "spelling")


@st.composite
def cases(draw: st.DrawFn, kinds: tuple[str, ...], compressed: bool,
          perturbations: tuple[str, ...]) -> Case:
    kind = draw(st.sampled_from(kinds))
    shape = draw(shapes())
    if kind in ("allgather", "allgatherv", "broadcast"):
        dtype = draw(st.sampled_from(REDUCIBLE + MOVABLE_ONLY))
    elif compressed:
        dtype = draw(st.sampled_from(FLOATS * 4 + INTS[:1]))  # integers: refused
    else:
        dtype = draw(st.sampled_from(REDUCIBLE * 4 + MOVABLE_ONLY[:2]))  # int8, uint8: refused
    op = draw(st.sampled_from(("sum", "avg") if compressed else OPS))
    if op == "avg" and dtype in INTS and draw(st.integers(0, 3)):
        op = "sum"  # avg on integers is refused: now and then
    swappable = np.dtype(dtype).itemsize > 1 and dtype != "bfloat16"
    swapped = swappable and draw(st.integers(0, 9)) == 0
    call = Call(
        kind=kind, shape=shape, dtype=dtype, swapped=swapped,
        layout=draw(st.sampled_from(("contiguous",) * 4 + LAYOUTS)),
        op=op, root=draw(st.integers(0, 7)) % SIZE,
        out=draw(st.sampled_from(OUTS_LEGAL)) if kind == "allreduce" else "none",
        compression=draw(st.sampled_from(tuple(COMPRESSIONS))) if compressed else "none",
        feedback=compressed and draw(st.booleans()),
        name=draw(st.sampled_from(("g", "fc1.weight", None))) if compressed else None,
        segment_bytes=draw(st.sampled_from(SEGMENTS)),
    )
    if call.feedback and call.name is None and draw(st.booleans()):
        call = replace(call, name="g")
    how = draw(st.sampled_from(("none",) * 4 + perturbations))
    how2 = draw(st.sampled_from(("none",) * 12 + perturbations))
    if how == "byteorder" and not swappable:
        how = "none"
    if how2 == "byteorder" and not swappable:
        how2 = "none"
    return Case(call, how, victim=draw(st.integers(0, 63)), alt=draw(st.integers(0, 7)),
                seed=draw(st.integers(0, 2**31 - 1)), repeat=draw(st.integers(0, 3)) == 0,
                special=draw(st.integers(0, 5)) == 0, perturbation2=how2)


# ------------------------------------------------------------------------------ the arrays
def np_dtype(name: str, swapped: bool = False) -> np.dtype:
    """The NumPy dtype called ``name``, in non-native byte order if ``swapped``."""
    dt = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    return dt.newbyteorder(SWAPPED) if swapped else dt


def values_for(c: Call, seed: int, rank: int, special: bool = False) -> np.ndarray:
    """This rank's logical input: C-contiguous, native byte order; with ``special``, floats
    hold a few NaN, Inf, -0.0 and large values."""
    rng = np.random.default_rng([seed, rank])
    n, name = c.size, c.dtype
    if name == "bool":
        flat = rng.integers(0, 2, n).astype(bool)
    elif name == "complex64":
        flat = (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(np.complex64)
    elif name in ("int8", "uint8", "int16", "uint32"):
        info = np.iinfo(name)
        flat = rng.integers(info.min, info.max, n, endpoint=True).astype(name)
    elif name in INTS:
        span = 3 if c.op == "prod" else 1000 if c.op == "sum" else 2**30
        flat = rng.integers(-span, span, n, endpoint=True).astype(name)
    elif c.op == "prod":
        flat = (rng.uniform(0.5, 1.5, n) * rng.choice([-1.0, 1.0], n)).astype(np_dtype(name))
    else:
        flat = rng.standard_normal(n).astype(np_dtype(name))
    if special and name in FLOATS and n:
        where = rng.integers(0, n, max(1, n // 500))
        flat[where] = rng.choice(np.array(SPECIALS), where.size).astype(flat.dtype)
    return flat.reshape(c.shape)


_FILES = itertools.count()


def place(values: np.ndarray, c: Call, tmpdir: Path) -> Any:
    """``values`` in ``c``'s byte order and memory layout."""
    a = values.astype(np_dtype(c.dtype, c.swapped))
    shape, layout = a.shape, c.layout
    if layout == "strided":
        big = np.zeros(2 * a.size, a.dtype)
        x = big[::2].reshape(shape)
    elif layout == "fortran":
        x = np.empty(shape, a.dtype, order="F")
    elif layout == "reversed" and a.ndim:
        x = np.flip(np.empty(shape, a.dtype))
    elif layout == "unaligned":
        buf = bytearray(a.nbytes + 1)
        x = np.frombuffer(buf, a.dtype, count=a.size, offset=1).reshape(shape)
    elif layout == "subclass":
        x = np.empty(shape, a.dtype).view(Sub)
    elif layout == "memmap" and a.size:
        path = tmpdir / f"x{next(_FILES)}.dat"
        x = np.memmap(path, dtype=a.dtype, mode="w+", shape=shape)
        path.unlink()  # the mapping stays; nothing piles up
    else:
        x = np.empty(shape, a.dtype)
    x[...] = a
    if c.readonly_x:
        x.flags.writeable = False
    return x.tolist() if c.as_list else x


def make_out(x: Any, c: Call, tmpdir: Path) -> tuple[Any, Any]:
    """(x, out) for an allreduce: ``x`` replaced when ``out`` must share its memory."""
    if c.kind != "allreduce" or c.out == "none" or c.as_list:
        return x, None
    shape, dtype = c.shape, np_dtype(c.dtype, c.swapped)
    if c.out == "inplace":
        return x, x
    if c.out == "alias":
        return x, x.view()
    if c.out in LAYOUTS:
        blank = Call("allreduce", shape, c.dtype, c.swapped, layout=c.out)
        return x, place(np.zeros(shape, np_dtype(c.dtype)), blank, tmpdir)
    if c.out == "shape":
        return x, np.empty((*shape, 2), dtype)
    if c.out == "dtype":
        return x, np.empty(shape, np.float32 if dtype != np.float32 else np.float64)
    if c.out == "readonly":
        out = np.empty(shape, dtype)
        out.flags.writeable = False
        return x, out
    if c.out == "list":
        return x, np.empty(shape, dtype).tolist()
    if c.out == "overlap":
        base = np.zeros(c.size + 1, dtype)
        moved = base[:c.size].reshape(shape)
        moved[...] = x
        return moved, base[1:].reshape(shape)
    raise AssertionError(f"unknown out {c.out!r}")


def make_feedback(c: Call) -> ringcomm.ErrorFeedback | None:
    """A fresh ErrorFeedback when ``c`` asks for one (holding a residual that does not fit, for
    a stale residual)."""
    if not c.feedback:
        return None
    ef = ringcomm.ErrorFeedback()
    if c.stale_residual and c.name:
        ef.take(c.name, np.zeros(c.size + 1, np.float32))  # a residual of another length
    return ef


def feedback_state(ef: ringcomm.ErrorFeedback | None) -> dict[str, str]:
    """The residuals ``ef`` holds, by name (as digests)."""
    return {} if ef is None else {name: digest(ef.residual(name)) for name in ef}


def invoke(comm: ringcomm.Communicator, c: Call, x: Any, out: Any,
           ef: ringcomm.ErrorFeedback | None) -> Any:
    """Make the call ``c`` describes."""
    op: Any = c.op
    root: Any = c.root
    if c.spelling != "plain" and c.op in OPS:  # the same op and root, spelled otherwise
        op = c.op.upper() if c.op in ("sum", "max") else ringcomm.ReduceOp(c.op)
        root = np.int64(c.root)
    if c.kind == "allreduce":
        comp = {"none": None, NOT_A_COMPRESSOR: "int8"}.get(c.compression)
        if c.compression not in ("none", NOT_A_COMPRESSOR):
            comp = COMPRESSIONS[c.compression]()
        return comm.allreduce(x, out, op=op, compression=comp, feedback=ef, name=c.name)
    if c.kind == "reduce_scatter":
        return comm.reduce_scatter(x, op=op)
    if c.kind == "allgather":
        return comm.allgather(x)
    if c.kind == "allgatherv":
        return comm.allgatherv(x)
    if c.kind == "broadcast":
        return comm.broadcast(x, root=root)
    return comm.barrier()


# ------------------------------------------------------------------------ cross-rank checks
def digest(a: Any) -> str:
    """Type, dtype, shape and bytes of ``a``, hashed."""
    if a is None:
        return "None"
    arr = np.ascontiguousarray(a)
    h = hashlib.sha1(f"{arr.dtype.str}{arr.shape}".encode())
    h.update(arr.reshape(-1).view(np.uint8).tobytes() if arr.size else b"")
    return h.hexdigest()


def native(a: Any) -> np.ndarray:
    """``a`` as a C-contiguous array in native byte order (the same values)."""
    arr = np.asarray(a)
    return np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("=")))


def agree_or_fail(world: MPI.Comm, problems: list[str], what: str) -> None:
    """Fail on every rank, with the same message, if any rank found a problem."""
    everyone = world.allgather(problems)
    if any(everyone):
        text = "\n".join(f"  rank {r}: {p}" for r, ps in enumerate(everyone) for p in ps)
        raise AssertionError(f"{what}:\n{text}")


def same_draw(world: MPI.Comm, case: Case) -> None:
    """Fail on every rank unless every rank drew ``case``."""
    mine = repr(case)
    everyone = world.allgather(mine)
    if len(set(everyone)) > 1:
        raise AssertionError("ranks drew different examples:\n" + "\n".join(
            f"  rank {r}: {d}" for r, d in enumerate(everyone)))


def reduce_reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    """The reduction of every rank's values: in the dtype for integers (wrapping alike), in
    float64 for floats."""
    stack = np.stack([np.asarray(v) for v in xs])
    if stack.dtype.kind in "iu":
        fn = {"sum": np.sum, "min": np.min, "max": np.max, "prod": np.prod}[op]
        return fn(stack, axis=0).astype(stack.dtype)
    wide = stack.astype(np.float64)
    if op in ("sum", "avg"):
        out = wide.sum(axis=0)
        return out / len(xs) if op == "avg" else out
    return {"min": np.min, "max": np.max, "prod": np.prod}[op](wide, axis=0)


def _finfo(name: str) -> Any:
    return ml_dtypes.finfo(ml_dtypes.bfloat16) if name == "bfloat16" else np.finfo(name)


def _first(mask: np.ndarray, got: np.ndarray, ref: np.ndarray) -> str:
    bad = np.flatnonzero(mask.reshape(-1))
    i = int(bad[0])
    return (f"at {bad.size} elements, first [{i}]: {got.reshape(-1)[i]!r} (expected "
            f"{ref.reshape(-1)[i]!r})")


def compare_reduction(got: Any, xs: list[np.ndarray], c: Call, special: bool) -> str | None:
    """Why ``got`` is not the reduction of ``xs`` under ``c`` (None when it is): exact for
    integers and min/max, within rounding for dense floats, loosely for compression, and
    never a finite number where the reference is NaN or Inf."""
    with np.errstate(invalid="ignore", over="ignore"):
        return _compare_reduction(got, xs, c, special)


def _compare_reduction(got: Any, xs: list[np.ndarray], c: Call, special: bool) -> str | None:
    ref = reduce_reference(xs, c.op)
    if c.dtype in INTS:
        got = np.asarray(got)
        wrong = got != ref
        return f"{c.op} differs from NumPy {_first(wrong, got, ref)}" if wrong.any() else None
    got = np.asarray(got).astype(np.float64)
    lost = ~np.isfinite(ref) & np.isfinite(got)
    if lost.any():
        return f"{c.op} turned NaN/Inf into a finite number {_first(lost, got, ref)}"
    if c.op in ("min", "max"):
        wrong = ~((got == ref) | (np.isnan(got) & np.isnan(ref)))
        return f"{c.op} differs from NumPy {_first(wrong, got, ref)}" if wrong.any() else None
    n = len(xs)
    stack = np.stack([np.asarray(v).astype(np.float64) for v in xs])
    if c.compression == "none":
        wrong = ~np.isfinite(ref) & ~((got == ref) | (np.isnan(got) & np.isnan(ref)))
        if wrong.any():
            return f"{c.op} of NaN/Inf differs from NumPy {_first(wrong, got, ref)}"
        tol = 4 * n * float(np.finfo(np.float32).eps)
        tol += float(_finfo(c.dtype).eps) if c.dtype in ("float16", "bfloat16") else 0.0
        scale = np.abs(ref) if c.op == "prod" else np.abs(stack).sum(axis=0)
        # Where the exact result overflows the dtype, Inf is right.
        checked = np.isfinite(ref) & (np.abs(ref) <= float(_finfo(c.dtype).max))
    elif c.compression in BOUNDED and not special:
        tol, scale = 0.05, np.abs(stack).reshape(n, -1).max(axis=1, initial=0.0).sum()
        checked = np.ones(ref.shape, bool)
    else:
        return None  # top-k drops entries, and a block with NaN decodes to NaN
    if c.op == "avg":
        scale = scale / n
    allowed = np.broadcast_to(tol * scale, ref.shape)
    wrong = checked & ~(np.abs(got - ref) <= allowed)
    if wrong.any():
        i = int(np.flatnonzero(wrong.reshape(-1))[0])
        return (f"{c.op} off by more than {allowed.reshape(-1)[i]:.3g} "
                f"{_first(wrong, got, ref)}")
    return None


@dataclass
class Outcome:
    """One rank's view of one call: the error raised, or the result's digest, and what its
    local checks found."""

    error: tuple[str, str] | None = None
    digest: str | None = None
    problems: list[str] = field(default_factory=list)
    chunk: np.ndarray | None = None  # reduce_scatter: this rank's chunk
    residual: np.ndarray | None = None  # error feedback: this rank's residual after the call


@dataclass
class Step:
    """One call of a case: what every rank passes, what must happen, and every rank's input."""

    case: Case
    first: bool
    calls: list[Call]
    expected: Prediction
    xs: list[np.ndarray] = field(default_factory=list)

    @property
    def mine(self) -> Call:
        return self.calls[RANK]


def run_once(comm: ringcomm.Communicator, world: MPI.Comm, case: Case, first: bool, tmpdir: Path,
             ef_box: dict[str, Any]) -> None:
    """Make one call of ``case`` on every rank, and check the promise across ranks."""
    calls = [case.call_on(r) for r in range(SIZE)]
    step = Step(case, first, calls, predict(calls))
    mine = step.mine
    if first:
        event(f"{case.call.kind} {case.perturbation}: {step.expected.outcome}")
        nbytes = case.call.size * np_dtype(case.call.dtype).itemsize
        event("size: " + ("zero" if not nbytes else "inline" if nbytes <= comm.inline_bytes
                          else "ring"))
    # Inputs first, on every rank; a harness failure fails everywhere before ringcomm runs.
    prep: list[str] = []
    values = x = out = None
    try:
        values = values_for(mine, case.seed, RANK, case.special)
        x, out = make_out(place(values, mine, tmpdir), mine, tmpdir)
        if first:
            ef_box["ef"] = make_feedback(mine)
    except Exception as err:  # a bug of this test: reported on every rank
        prep.append(f"building the inputs failed: {type(err).__name__}: {err}")
    step.xs = world.allgather(values)
    agree_or_fail(world, prep, "test harness")
    ef = ef_box["ef"]
    previous = comm.segment_bytes
    residuals = feedback_state(ef)
    outcome = Outcome()
    result: Any = None
    try:
        if mine.segment_bytes and mine.segment_bytes != previous:
            comm.segment_bytes = mine.segment_bytes  # (the setter drops cached plans)
        result = invoke(comm, mine, x, out, ef)
    except Exception as err:
        outcome.error = (f"{type(err).__module__}.{type(err).__qualname__}", str(err))
        outcome.problems.extend(error_problems(err, calls, step.expected))
        if feedback_state(ef) != residuals:
            outcome.problems.append("a call that raised changed the error feedback residuals")
    finally:
        if comm.segment_bytes != previous:
            comm.segment_bytes = previous
    try:
        check_result(step, outcome, result, values, x, out)
        if outcome.error is None and ef is not None and mine.name in ef:
            outcome.residual = np.array(ef.residual(mine.name))
            if not np.all(np.isfinite(outcome.residual)):
                outcome.problems.append("the error feedback residual holds NaN or Inf")
    except Exception as err:  # a bug of this test (or a result of an unexpected kind)
        outcome.problems.append(f"checking the result failed: {type(err).__name__}: {err}")
    everyone = world.allgather(outcome)
    problems = list(outcome.problems)
    if RANK == 0:  # what is seen across ranks is the same everywhere: said once
        problems.extend(cross_rank_problems(step, everyone))
    agree_or_fail(world, problems, f"{case.call.kind} broke the promise (call "
                                   f"{1 if first else 2}, {case.describe()})")


def cross_rank_problems(step: Step, everyone: list[Outcome]) -> list[str]:
    """What the ranks' outcomes, side by side, break of the promise."""
    errors = {o.error for o in everyone}
    if len(errors) > 1:
        return ["not the same outcome on every rank: " + "; ".join(
            f"rank {r}: {o.error or 'returned'}" for r, o in enumerate(everyone))]
    error, expected = everyone[0].error, step.expected
    if error is not None:
        if expected.outcome == "ok":
            return [f"raised {error[0]}: {error[1]}, expected a result"]
        return []
    problems = []
    if expected.outcome == "error":
        assert expected.error is not None
        problems.append(f"returned, expected {expected.error.__name__} ({expected.why})")
    if all(c.kind == "reduce_scatter" for c in step.calls):
        problems.extend(check_scatter(step, everyone))
    elif len({o.digest for o in everyone}) > 1:
        problems.append("results differ between ranks: " + ", ".join(
            f"rank {r} {str(o.digest)[:12]}" for r, o in enumerate(everyone)))
    residuals = [o.residual for o in everyone]
    if expected.outcome == "ok" and step.first and not step.case.special and all(
            r is not None for r in residuals):
        problems.extend(check_conservation(step, everyone))
    return problems


def check_conservation(step: Step, everyone: list[Outcome]) -> list[str]:
    """Error feedback loses nothing: the result (times n for avg) plus every rank's residual
    is the sum of the inputs, to float32 rounding."""
    c, n = step.mine, SIZE
    if c.size == 0:
        return []
    inputs = np.stack([np.asarray(v).astype(np.float64).reshape(-1) for v in step.xs])
    residuals = np.stack([np.asarray(o.residual, np.float64).reshape(-1) for o in everyone])
    result = everyone[0].chunk
    assert result is not None
    total = result.astype(np.float64) * (n if c.op == "avg" else 1) + residuals.sum(axis=0)
    scale = np.abs(inputs).sum(axis=0) + np.abs(residuals).sum(axis=0)
    tol = 8 * n * float(np.finfo(np.float32).eps)
    if c.dtype in ("float16", "bfloat16"):
        tol += n * float(_finfo(c.dtype).eps)  # results are rounded to the input's dtype
    wrong = np.abs(total - inputs.sum(axis=0)) > tol * scale + 1e-30
    if wrong.any():
        return ["result + residuals != sum of the inputs " + _first(
            wrong, total, inputs.sum(axis=0))]
    return []


def check_result(step: Step, outcome: Outcome, result: Any, values: Any, x: Any,
                 out: Any) -> None:
    """Local checks of one rank's call; fills ``outcome``. Where every rank made a valid,
    matching call (predicted "ok"), the result is compared with a NumPy reference."""
    c, p = step.mine, outcome.problems
    returned = outcome.error is None
    writes_x = c.kind == "broadcast" or c.out in ("inplace", "alias")
    if not c.as_list and not (returned and writes_x) and c.kind != "barrier":
        if digest(native(x)) != digest(values):
            p.append("x was modified" + (" (by a call that raised)" if not returned else ""))
    if not returned:
        return
    reference = step.expected.outcome == "ok"
    if c.kind == "barrier":
        outcome.digest = digest(result)
    elif c.kind == "allreduce":
        if out is not None and result is not out:
            p.append(f"returned a {type(result).__name__}, not out")
        arr = np.asarray(result)
        if arr.shape != c.shape or arr.dtype != np_dtype(c.dtype):
            p.append(f"result {arr.dtype}{arr.shape}, expected {c.dtype}{c.shape}")
        outcome.digest = digest(arr)
        outcome.chunk = arr.reshape(-1)  # for the conservation check of error feedback
        if reference and step.first and c.size:
            why = compare_reduction(arr, step.xs, c, step.case.special)
            if why:
                p.append(why)
    elif c.kind == "reduce_scatter":
        arr = np.asarray(result)
        lo, hi = RANK * c.size // SIZE, (RANK + 1) * c.size // SIZE
        if arr.shape != (hi - lo,) or arr.dtype != np_dtype(c.dtype):
            p.append(f"chunk {arr.dtype}{arr.shape}, expected {c.dtype}({hi - lo},)")
        outcome.chunk = arr
    elif c.kind in ("allgather", "allgatherv"):
        arr = np.asarray(result)
        dt = np_dtype(c.dtype, c.swapped)
        if arr.dtype != dt:
            p.append(f"result dtype {arr.dtype.str}, expected {dt.str}")
        outcome.digest = digest(arr)
        if reference:
            ref = np.concatenate([np.asarray(v) for v in step.xs])
            if arr.shape != ref.shape or digest(native(arr)) != digest(native(ref)):
                p.append(f"{c.kind} result {arr.shape} is not the ranks' inputs in rank order")
    elif c.kind == "broadcast":
        if result is not x:
            p.append(f"broadcast returned a {type(result).__name__}, not x")
        arr = np.asarray(x)
        outcome.digest = digest(arr)
        if reference and digest(native(arr)) != digest(native(step.xs[c.root])):
            p.append(f"x is not root {c.root}'s input after broadcast")


def check_scatter(step: Step, everyone: list[Outcome]) -> list[str]:
    """The ranks' reduce_scatter chunks, in rank order, are the whole reduction."""
    chunks = [o.chunk for o in everyone]
    if any(ch is None for ch in chunks):
        return ["a rank returned no chunk"]
    c = step.calls[0]
    whole = np.concatenate([np.asarray(ch).reshape(-1) for ch in chunks])
    if whole.size != c.size:
        return [f"chunks hold {whole.size} elements, expected {c.size}"]
    if step.expected.outcome != "ok" or not c.size:
        return []
    flat = [np.asarray(v).reshape(-1) for v in step.xs]
    why = compare_reduction(whole, flat, replace(c, shape=(c.size,)), step.case.special)
    return [f"reduce_scatter: {why}"] if why else []


def still_usable(comm: ringcomm.Communicator, world: MPI.Comm) -> None:
    """A small (inline) and a larger (ring) allreduce return the right values everywhere."""
    problems = []
    total = SIZE * (SIZE + 1) // 2
    try:
        small = comm.allreduce(np.full(3, RANK + 1, np.int64))
        if not np.array_equal(small, np.full(3, total)):
            problems.append(f"inline allreduce gave {small}, expected {total}")
        n = comm.inline_bytes // 8 + 100  # float64: past the inline path
        ring = comm.allreduce(np.arange(n, dtype=np.float64) * (RANK + 1), op="max")
        if not np.array_equal(ring, np.arange(n, dtype=np.float64) * SIZE):
            problems.append("ring allreduce gave wrong values")
    except Exception as err:
        problems.append(f"follow-up allreduce raised {type(err).__name__}: {err}")
    agree_or_fail(world, problems, "the communicator is not usable after the call")


def check_case(comm: ringcomm.Communicator, world: MPI.Comm, case: Case, tmpdir: Path) -> None:
    """The property, for one drawn example."""
    same_draw(world, case)
    ef_box: dict[str, Any] = {}
    for i in range(2 if case.repeat else 1):
        run_once(comm, world, case, i == 0, tmpdir, ef_box)
    still_usable(comm, world)


@pytest.fixture(scope="module")
def rank_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of this rank's own, for memmaps."""
    return tmp_path_factory.mktemp(f"properties-r{RANK}")


# ---------------------------------------------------------------------------------- tests
@pytest.mark.timeout(180)
@settings(max_examples=EXAMPLES, **SETTINGS)
@given(case=cases(("allreduce",), False, DENSE_PERTURBATIONS))
@example(case=Case(Call("allreduce", (0, 5), "float32"), "shape", 1, 0, 1, False))
@example(case=Case(Call("allreduce", (3, 0), "int64", out="contiguous"), "none", 0, 0, 2, True))
@example(case=Case(Call("allreduce", (70_001,), "float32", layout="unaligned"), "layout",
                   1, 3, 3, False))
def test_dense_allreduce(comm: ringcomm.Communicator, world: MPI.Comm, rank_dir: Path,
                         case: Case) -> None:
    """Dense allreduce: every op and out, inline and ring, refusals and mismatches."""
    check_case(comm, world, case, rank_dir)


@pytest.mark.timeout(180)
@settings(max_examples=EXAMPLES, **SETTINGS)
@given(case=cases(("allreduce",), True, COMPRESSED_PERTURBATIONS))
@example(case=Case(Call("allreduce", (0,), "float32", compression="int8", feedback=True,
                        name="w"), "feedback", 0, 0, 4, False))
@example(case=Case(Call("allreduce", (5000,), "float32", compression="topk", feedback=True,
                        name="w"), "name", 1, 1, 5, True))
def test_compressed_allreduce(comm: ringcomm.Communicator, world: MPI.Comm, rank_dir: Path,
                              case: Case) -> None:
    """Compressed allreduce: every compressor, with and without error feedback."""
    check_case(comm, world, case, rank_dir)


@pytest.mark.timeout(180)
@settings(max_examples=EXAMPLES, **SETTINGS)
@given(case=cases(("reduce_scatter", "allgather", "allgatherv", "broadcast"), False,
                  GATHER_PERTURBATIONS))
@example(case=Case(Call("allgatherv", (3, 0), "uint8"), "shape", 1, 0, 6, False))
@example(case=Case(Call("broadcast", (1000,), "float64", root=0, layout="unaligned"), "root",
                   1, 0, 7, False))
def test_other_collectives(comm: ringcomm.Communicator, world: MPI.Comm, rank_dir: Path,
                           case: Case) -> None:
    """reduce_scatter, allgather, allgatherv and broadcast: refusals and mismatches."""
    check_case(comm, world, case, rank_dir)


@pytest.mark.parametrize("algorithm", ["ring", "allgather"])
def test_topk_keeps_non_finite_entries_first(comm: ringcomm.Communicator, world: MPI.Comm,
                                             algorithm: str) -> None:
    """README: top-k sends NaN and Inf before any number; a selection that cannot carry them
    all sends its overflow mark. With k = 1 and two Inf, neither comes out finite (the chunk
    that held them is NaN)."""
    if SIZE < 2:
        pytest.skip("needs 2 ranks: nothing is selected in one process")
    x = np.ones(64, np.float32)
    x[:2] = np.inf
    y = comm.allreduce(x, compression=ringcomm.TopK(0.01, algorithm=algorithm))
    problems = [] if not np.isfinite(y[:2]).any() else [f"y[:2] = {y[:2]}"]
    agree_or_fail(world, problems, "an Inf turned into a finite number")
