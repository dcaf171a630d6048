"""ctypes binding of the parts of libnccl.so.2 the NCCL backend uses.

The library is looked up in the nvidia-nccl-cu12 / nvidia-nccl-cu13 wheels first (both install
it as ``nvidia/nccl/lib/libnccl.so.2``; ``nvidia/cu13/lib`` is searched too), then wherever the
dynamic loader finds ``libnccl.so.2`` (a site NCCL on ``LD_LIBRARY_PATH``). Loading, version
and unique-id calls need no GPU. Reduce ops take their ncclRedOp_t from the one table of
reduce ops (``ReduceOp.X.spec.nccl``). One module, about 400 lines: the prototypes and the
calls of one C library, side by side.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
import threading
from typing import Any

import numpy as np

from ringcomm.ops import _cuda_stack

__all__ = [
    "DTYPES",
    "IN_PROGRESS",
    "MIN_VERSION",
    "UINT8",
    "NCCLComm",
    "NCCLError",
    "NCCLLibrary",
    "candidate_paths",
    "dtype_code",
    "format_version",
    "load",
]

# ncclGetLastError and ncclCommFinalize arrived in 2.13/2.14; ncclAvg and bfloat16 in 2.10.
MIN_VERSION = 21400
UNIQUE_ID_BYTES = 128
#: ncclInProgress: what ncclCommGetAsyncError reports while a nonblocking call is under way.
IN_PROGRESS = 7

# ncclDataType_t, by NumPy dtype name (bfloat16 is ml_dtypes' name for it).
DTYPES: dict[str, int] = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
}
UINT8 = DTYPES["uint8"]

_void_p, _int, _size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


# (name, argument types); every function returns ncclResult_t unless listed in _RESTYPES.
_PROTOTYPES: tuple[tuple[str, list[Any]], ...] = (
    ("ncclGetVersion", [ctypes.POINTER(_int)]),
    ("ncclGetUniqueId", [ctypes.POINTER(_UniqueId)]),
    ("ncclCommInitRank", [ctypes.POINTER(_void_p), _int, _UniqueId, _int]),
    ("ncclCommFinalize", [_void_p]),
    ("ncclCommDestroy", [_void_p]),
    ("ncclCommAbort", [_void_p]),
    ("ncclCommGetAsyncError", [_void_p, ctypes.POINTER(_int)]),
    ("ncclCommCount", [_void_p, ctypes.POINTER(_int)]),
    ("ncclCommUserRank", [_void_p, ctypes.POINTER(_int)]),
    ("ncclGetErrorString", [_int]),
    ("ncclGetLastError", [_void_p]),
    ("ncclAllReduce", [_void_p, _void_p, _size_t, _int, _int, _void_p, _void_p]),
    ("ncclReduceScatter", [_void_p, _void_p, _size_t, _int, _int, _void_p, _void_p]),
    ("ncclAllGather", [_void_p, _void_p, _size_t, _int, _void_p, _void_p]),
    ("ncclBroadcast", [_void_p, _void_p, _size_t, _int, _int, _void_p, _void_p]),
    ("ncclSend", [_void_p, _size_t, _int, _int, _void_p, _void_p]),
    ("ncclRecv", [_void_p, _size_t, _int, _int, _void_p, _void_p]),
    ("ncclGroupStart", []),
    ("ncclGroupEnd", []),
)
_RESTYPES = {"ncclGetErrorString": ctypes.c_char_p, "ncclGetLastError": ctypes.c_char_p}
# Bound where the library has them: ncclCommSplit arrived in NCCL 2.18.
_OPTIONAL_PROTOTYPES: tuple[tuple[str, list[Any]], ...] = (
    ("ncclCommSplit", [_void_p, _int, _int, ctypes.POINTER(_void_p), _void_p]),
)


class NCCLError(RuntimeError):
    """An NCCL call failed; the message carries ncclGetErrorString and ncclGetLastError.

    Attributes:
        code: the ncclResult_t value.
    """

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def candidate_paths() -> list[str]:
    """Where libnccl.so.2 is looked for, in order: the NVIDIA wheels, then the loader's path."""
    dirs: list[str] = []
    for root in _nvidia_roots():
        dirs += [os.path.join(root, "nccl", "lib"), os.path.join(root, "cu13", "lib")]
    found = [os.path.join(d, "libnccl.so.2") for d in dirs]
    return [p for p in found if os.path.exists(p)] + ["libnccl.so.2"]


def _nvidia_roots() -> list[str]:
    """The directories of the ``nvidia`` namespace package the NVIDIA wheels install into."""
    module = sys.modules.get("nvidia")
    if module is not None:
        return list(getattr(module, "__path__", []))
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec is not None else []


def format_version(code: int) -> str:
    """Turn ncclGetVersion's integer (e.g. 23203) into "2.32.3"."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"  # before 2.9: 2708 is 2.7.8


class NCCLLibrary:
    """libnccl.so.2 with the prototypes ringcomm calls.

    Hot-path calls go straight to ``self.fn`` (the ctypes functions); everything else through
    methods that check the result.

    Args:
        path: the shared library to load.

    Attributes:
        can_split: whether the library has ``ncclCommSplit`` (NCCL 2.18 and newer).

    Raises:
        OSError: the library cannot be loaded.
        AttributeError: a function ringcomm needs is missing.
        RuntimeError: it is older than ``MIN_VERSION``.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lib = ctypes.CDLL(path)
        self.fn: dict[str, Any] = {}
        optional = [p for p in _OPTIONAL_PROTOTYPES if hasattr(self._lib, p[0])]
        for name, argtypes in (*_PROTOTYPES, *optional):
            f = getattr(self._lib, name)
            f.argtypes = argtypes
            f.restype = _RESTYPES.get(name, _int)
            self.fn[name] = f
        self.can_split = "ncclCommSplit" in self.fn
        self.version = self._version()
        if self.version < MIN_VERSION:
            raise RuntimeError(
                f"{path} is NCCL {format_version(self.version)}; ringcomm needs "
                f"{format_version(MIN_VERSION)} or newer: {_cuda_stack.install_hint()}")

    def _version(self) -> int:
        v = _int()
        self.check(self.fn["ncclGetVersion"](ctypes.byref(v)), "ncclGetVersion")
        return v.value

    @property
    def version_string(self) -> str:
        """The library's version, as "2.32.3"."""
        return format_version(self.version)

    def error_text(self, code: int, comm: Any = None) -> str:
        """Describe result ``code`` with NCCL's own words: its error string and last error."""
        text = (self.fn["ncclGetErrorString"](code) or b"").decode(errors="replace")
        last = (self.fn["ncclGetLastError"](comm) or b"").decode(errors="replace").strip()
        return f"NCCL error {code}: {text}" + (f"; last error: {last}" if last else "")

    def check(self, code: int, what: str, comm: Any = None) -> None:
        """Raise NCCLError naming ``what`` unless ``code`` is ncclSuccess.

        Raises:
            NCCLError: ``code`` is not 0.
        """
        if code:
            raise NCCLError(f"{what} failed: {self.error_text(code, comm)}", code)

    def unique_id(self) -> bytes:
        """A fresh ncclUniqueId (128 bytes); rank 0 makes it and the others receive it."""
        uid = _UniqueId()
        self.check(self.fn["ncclGetUniqueId"](ctypes.byref(uid)), "ncclGetUniqueId")
        return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)

    def init_rank(self, nranks: int, uid: bytes, rank: int) -> ctypes.c_void_p:
        """Create this rank's communicator of ``nranks`` on the current CUDA device.

        Raises:
            ValueError: ``uid`` is not a 128-byte unique id.
            NCCLError: NCCL refused (bad device, peers unreachable, ...).
        """
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        handle = _void_p()
        ident = _UniqueId()
        ctypes.memmove(ctypes.addressof(ident), uid, UNIQUE_ID_BYTES)
        code = self.fn["ncclCommInitRank"](ctypes.byref(handle), nranks, ident, rank)
        self.check(code, f"ncclCommInitRank (rank {rank} of {nranks})")
        return handle

    def destroy(self, comm: Any) -> None:
        """Finish the outstanding work of communicator ``comm`` and free it."""
        self.check(self.fn["ncclCommFinalize"](comm), "ncclCommFinalize", comm)
        self.check(self.fn["ncclCommDestroy"](comm), "ncclCommDestroy")

    def comm_shape(self, comm: Any) -> tuple[int, int]:
        """(rank, number of ranks) of communicator ``comm``, as NCCL numbers them."""
        rank, count = _int(), _int()
        self.check(self.fn["ncclCommUserRank"](comm, ctypes.byref(rank)), "ncclCommUserRank",
                   comm)
        self.check(self.fn["ncclCommCount"](comm, ctypes.byref(count)), "ncclCommCount", comm)
        return rank.value, count.value


class NCCLComm:
    """One NCCL communicator: enqueue calls on a given stream, checking every result.

    Buffers are device pointers and sizes; point-to-point calls move bytes. Made by
    :meth:`create` or :meth:`split`.

    Args:
        lib: the loaded library.
        handle: the ncclComm_t.
        rank, size: this rank and the number of ranks, as NCCL numbers them.
    """

    __slots__ = ("fn", "handle", "lib", "rank", "size")

    def __init__(self, lib: NCCLLibrary, handle: Any, rank: int, size: int) -> None:
        self.lib, self.fn, self.handle, self.rank, self.size = lib, lib.fn, handle, rank, size

    @classmethod
    def create(cls, lib: NCCLLibrary, nranks: int, uid: bytes, rank: int) -> NCCLComm:
        """Create rank ``rank`` of ``nranks`` on the current CUDA device (``ncclCommInitRank``).

        Raises:
            ValueError: ``uid`` is not a 128-byte unique id.
            NCCLError: NCCL refused (bad device, peers unreachable, ...).
        """
        return cls(lib, lib.init_rank(nranks, uid, rank), rank, nranks)

    def split(self, color: int, key: int) -> NCCLComm:
        """The communicator of the ranks that pass the same ``color`` (``ncclCommSplit``).

        Collective over this communicator's ranks; ranks are ordered by (key, rank here), as
        MPI_Comm_split orders them. The new communicator keeps this one's configuration.

        Raises:
            NotImplementedError: the library is older than NCCL 2.18 (``lib.can_split``).
            NCCLError: NCCL refused.
        """
        if not self.lib.can_split:
            raise NotImplementedError(
                f"ncclCommSplit needs NCCL 2.18 or newer, this is {self.lib.version_string}")
        handle = _void_p()
        code = self.fn["ncclCommSplit"](self.handle, color, key, ctypes.byref(handle), None)
        self.check(code, f"ncclCommSplit (color {color}, key {key})")
        return NCCLComm(self.lib, handle, *self.lib.comm_shape(handle))

    def check(self, code: int, what: str) -> None:
        """Raise NCCLError (with this communicator's last error) unless ``code`` is 0."""
        if code:
            self.lib.check(code, what, self.handle)

    def group(self) -> _Group:
        """A ``with`` block whose calls NCCL runs as one group."""
        return _Group(self)

    def reduce(self, name: str, send: int, recv: int, count: int, dtype: int, op: int,
               stream: int) -> None:
        """Enqueue ncclAllReduce or ncclReduceScatter (``count``: elements per output)."""
        self.check(self.fn[name](send, recv, count, dtype, op, self.handle, stream), name)

    def allgather(self, send: int, recv: int, nbytes: int, stream: int) -> None:
        """Enqueue ncclAllGather of ``nbytes`` from every rank."""
        self.check(self.fn["ncclAllGather"](send, recv, nbytes, UINT8, self.handle, stream),
                   "ncclAllGather")

    def broadcast(self, buf: int, nbytes: int, root: int, stream: int) -> None:
        """Enqueue an in-place ncclBroadcast of ``nbytes`` from ``root``."""
        self.check(self.fn["ncclBroadcast"](buf, buf, nbytes, UINT8, root, self.handle, stream),
                   "ncclBroadcast")

    def sendrecv(self, send: tuple[int, int] | None, dest: int, recv: tuple[int, int] | None,
                 source: int, stream: int) -> None:
        """Enqueue a send and a receive of (pointer, bytes), either may be None, as one group."""
        with self.group():
            if recv is not None:
                self._recv(recv[0], recv[1], source, stream)
            if send is not None:
                self._send(send[0], send[1], dest, stream)

    def gatherv(self, send: int, recv: int, nbytes: list[int], stream: int) -> None:
        """Enqueue the exchanges of an allgatherv: rank p's ``nbytes[p]`` land at their offset
        in ``recv``. This rank's own part is not copied."""
        offsets = np.concatenate([[0], np.cumsum(nbytes)]).tolist()
        with self.group():
            for p in range(self.size):
                if p == self.rank:
                    continue
                if nbytes[p]:
                    self._recv(recv + offsets[p], nbytes[p], p, stream)
                if nbytes[self.rank]:
                    self._send(send, nbytes[self.rank], p, stream)

    def destroy(self) -> None:
        """Finish the communicator's outstanding work and free it."""
        self.lib.destroy(self.handle)

    def async_error(self) -> int:
        """ncclCommGetAsyncError: 0 while the communicator is healthy, ``IN_PROGRESS`` while a
        call is still being set up, another ncclResult_t once an operation has failed (a peer
        died, the network broke). Safe to call from any thread while operations run."""
        state = _int()
        code = self.fn["ncclCommGetAsyncError"](self.handle, ctypes.byref(state))
        return int(code or state.value)

    def describe(self, code: int) -> str:
        """NCCL's words for result ``code`` of this communicator (error string, last error)."""
        return self.lib.error_text(code, self.handle)

    def abort(self) -> None:
        """ncclCommAbort: stop the communicator's outstanding operations (their kernels return)
        and free it; waits for no peer. The handle is invalid afterwards.

        Raises:
            NCCLError: NCCL refused.
        """
        self.check(self.fn["ncclCommAbort"](self.handle), "ncclCommAbort")

    def _send(self, buf: int, nbytes: int, peer: int, stream: int) -> None:
        code = self.fn["ncclSend"](buf, nbytes, UINT8, peer, self.handle, stream)
        if code:
            self.check(code, f"ncclSend of {nbytes} bytes to rank {peer}")

    def _recv(self, buf: int, nbytes: int, peer: int, stream: int) -> None:
        code = self.fn["ncclRecv"](buf, nbytes, UINT8, peer, self.handle, stream)
        if code:
            self.check(code, f"ncclRecv of {nbytes} bytes from rank {peer}")


class _Group:
    """ncclGroupStart / ncclGroupEnd around a block, ended even when a call inside fails."""

    __slots__ = ("_comm",)

    def __init__(self, comm: NCCLComm) -> None:
        self._comm = comm

    def __enter__(self) -> None:
        self._comm.check(self._comm.fn["ncclGroupStart"](), "ncclGroupStart")

    def __exit__(self, etype: Any, *rest: Any) -> None:
        code = self._comm.fn["ncclGroupEnd"]()
        if etype is None:
            self._comm.check(code, "ncclGroupEnd")


def dtype_code(dtype: Any) -> int:
    """The ncclDataType_t of ``dtype``.

    Raises:
        TypeError: NCCL has no such type.
    """
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    code = DTYPES.get(name)
    if code is None:
        raise TypeError(f"NCCL has no type for dtype {name}; expected one of "
                        + ", ".join(DTYPES))
    return code


_loaded: list[NCCLLibrary] = []
_lock = threading.Lock()


def load() -> NCCLLibrary:
    """Load NCCL once per process and return it.

    Raises:
        RuntimeError: no usable libnccl.so.2 was found; the message says what to install.
    """
    if _loaded:
        return _loaded[0]
    with _lock:
        if _loaded:
            return _loaded[0]
        problems = []
        for path in candidate_paths():
            try:
                _loaded.append(NCCLLibrary(path))
                return _loaded[0]
            except (OSError, AttributeError, RuntimeError) as err:
                problems.append(f"{path}: {err}")
        raise RuntimeError("the NCCL backend could not load NCCL (" + "; ".join(problems)
                           + f"); install it with {_cuda_stack.install_hint()}")
