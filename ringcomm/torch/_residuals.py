"""Error-feedback residuals of fused buffers, kept right when the buffers are cut anew.

A fused buffer (a DDP bucket, a fusion buffer of the optimizer) holds several tensors at known
offsets, and its residual is one flat vector. When the buffers are re-cut (DDP rebuilds its
buckets after the first iteration; the optimizer re-plans when ``requires_grad`` changes), the
pieces of the old residuals move to wherever their tensors now live, so no gradient mass that
compression held back is lost or added to the wrong tensor.

Tensors may be known by ``id()`` (the DDP hook's parameters), which a new tensor can take once
the old one is gone: :meth:`ResidualLayouts.watch` drops what a tensor left behind when it is
collected, so a new model's parameter never starts from a dead one's residual.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

from ringcomm import ops as _ops
from ringcomm.algorithms.compressed_ring import add_rounding
from ringcomm.algorithms.ring import chunk_bounds
from ringcomm.codecs.feedback import ErrorFeedback
from ringcomm.core.types import ReduceOp
from ringcomm.torch._tensors import Operand, as_array

__all__ = ["Layout", "ResidualLayouts", "check_grad_scaler", "keep_write_back_rounding",
           "rescaling"]

#: (tensor key, offset in the buffer, number of elements) per tensor of a buffer.
Layout = tuple[tuple[Hashable, int, int], ...]


class ResidualLayouts:
    """Residuals of named fused buffers that follow their tensors across re-cuts.

    Args:
        feedback: the ErrorFeedback that stores the residuals under the buffers' names.
    """

    __slots__ = ("__weakref__", "_dead", "_layouts", "_lock", "_owner", "_stash", "_watched",
                 "feedback")

    def __init__(self, feedback: ErrorFeedback) -> None:
        self.feedback = feedback
        self._layouts: dict[str, Layout] = {}
        self._owner: dict[Hashable, str] = {}
        self._stash: dict[Hashable, Any] = {}
        self._watched: set[Hashable] = set()
        self._dead: list[Hashable] = []  # keys of collected tensors, not yet dropped
        # align runs on the thread of the collectives, piece on the caller's: one at a time.
        self._lock = threading.RLock()

    def watch(self, key: Hashable, tensor: Any) -> None:
        """Drop the residual kept under ``key`` (its piece, wherever it is) once ``tensor``,
        which ``key`` stands for, is collected: the key (an ``id()``) may then name another."""
        if key in self._watched:
            return
        self._watched.add(key)
        weakref.finalize(tensor, _died, weakref.ref(self), key)

    def _bury(self) -> None:
        """Drop what the collected tensors left: their stashed pieces, and their slices of the
        residuals that hold them (zeroed, their key in the layout replaced by one that matches
        no tensor). Called before residuals move, on the thread that runs the collectives."""
        while self._dead:
            key = self._dead.pop()
            self._stash.pop(key, None)
            owner = self._owner.pop(key, None)
            if owner is None:
                continue
            residual = self.feedback.residual(owner)
            layout = []
            for k, off, n in self._layouts[owner]:
                if k == key:
                    if residual is not None:
                        residual[off: off + n] = 0
                    k = _Gone()
                layout.append((k, off, n))
            self._layouts[owner] = tuple(layout)

    def align(self, name: str, layout: Layout, like: Any | Callable[[], Any]) -> None:
        """Make the residual under ``name`` match ``layout`` before a compressed call.

        Args:
            name: the buffer's name (the ErrorFeedback key).
            layout: the tensors the buffer holds now.
            like: the flat buffer as an array (the residual is created on its device, with its
                length), or a function returning it, called only if a residual is created.
        """
        with self._lock:
            self._align(name, layout, like)

    def _align(self, name: str, layout: Layout, like: Any | Callable[[], Any]) -> None:
        self._bury()
        if self._layouts.get(name) == layout:
            kept = self.feedback.residual(name)
            if kept is None:
                return
            like = like() if callable(like) else like
            if _ops.is_device_array(kept) == _ops.is_device_array(like):
                return
            # The same cut moved between the host and a GPU (model.cuda() keeps the Parameter
            # objects): the residual follows its tensors there.
        self._release(name)
        for key, _, _ in layout:
            owner = self._owner.get(key)
            if owner is not None:
                self._release(owner)
        pieces = [(off, n, self._stash.pop(key)) for key, off, n in layout if key in self._stash]
        if pieces:
            residual = self.feedback.take(name, like() if callable(like) else like)
            for off, n, piece in pieces:
                if piece.size == n:  # a tensor that changed size starts afresh
                    _put(residual[off: off + n], piece)
        self._layouts[name] = layout
        for key, _, _ in layout:
            self._owner[key] = name

    def _release(self, name: str) -> None:
        """Move the residual of ``name`` into per-tensor pieces and forget its layout."""
        layout = self._layouts.pop(name, None)
        if layout is None:
            return
        residual = self.feedback.residual(name)
        for key, off, n in layout:
            if self._owner.get(key) == name:
                del self._owner[key]
            if residual is not None and not isinstance(key, _Gone):
                self._stash[key] = residual[off: off + n].copy()
        self.feedback.reset(name)

    def piece(self, key: Hashable) -> Any | None:
        """The residual kept for one tensor (a flat float32 array), or None if it has none."""
        with self._lock:
            return self._piece(key)

    def _piece(self, key: Hashable) -> Any | None:
        self._bury()
        if key in self._stash:
            return self._stash[key]
        owner = self._owner.get(key)
        residual = None if owner is None else self.feedback.residual(owner)
        if residual is None or owner is None:
            return None
        for k, off, n in self._layouts[owner]:
            if k == key:
                return residual[off: off + n]
        return None

    def scale(self, factor: float) -> None:
        """Multiply every residual, and every piece waiting for a buffer, by ``factor``."""
        with self._lock:
            self._scale(factor)

    def _scale(self, factor: float) -> None:
        for name in self.feedback.names():
            residual = self.feedback.residual(name)
            if residual is not None:
                residual *= factor
        for piece in self._stash.values():
            piece *= factor

    def pending(self) -> int:
        """Number of tensors whose residual waits for a buffer to hold them again."""
        return len(self._stash)


def keep_write_back_rounding(feedback: ErrorFeedback | None, name: str | None,
                             operand: Operand, op: str, rank: int, size: int) -> None:
    """Add to the residual of ``name`` what writing a compressed call's float32 result back
    into a bfloat16 tensor (``operand``, written back) rounded away (``add_rounding``: times
    ``size`` for "avg", the residual's units), this rank the elements of its own chunk of the
    ring's split, so that the ranks' residuals hold it once, as the communicator keeps the
    rounding of a float16 result. Nothing where no residual is kept under ``name``: a dense
    call (never compressed, or "auto" choosing dense with nothing held) rounds as DDP's own
    does."""
    if (feedback is None or name is None or not feedback.holds(name) or not operand.widened
            or not operand.tensor.is_floating_point()):
        return
    exact = operand.array.reshape(-1)  # the float32 copy the result was written into
    rounded = as_array(operand.tensor.detach().reshape(-1).float())
    lo, hi = chunk_bounds(exact.size, size)[rank: rank + 2]
    residual = feedback.take(name, exact)
    add_rounding(_ops.get(exact), residual[lo:hi], exact[lo:hi], rounded[lo:hi],
                 ReduceOp.parse(op), size)


def check_grad_scaler(grad_scaler: Any) -> None:
    """Raise TypeError unless ``grad_scaler`` is None or has a GradScaler's ``get_scale()``."""
    if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler (with get_scale()), got "
                        f"{type(grad_scaler).__qualname__}")


def rescaling(before: float | None, scale: float) -> float | None:
    """The factor that takes residuals kept at loss scale ``before`` to ``scale``; None where
    there is nothing to do (the first scale seen, the same one, or one not finite and
    positive).

    0 where the scale fell: a GradScaler backs off only after a step it skipped (a gradient
    not finite on some rank), and that step's calls have already moved every residual, the
    finite buckets' too (top-k's took in nearly all of the step's gradient): kept, they would
    apply the skipped step's gradients in the steps after it. Dropped, the skipped step adds
    nothing later; what the residuals held before it is lost with it.
    """
    if before is None or scale == before or not (0 < scale < math.inf and before > 0):
        return None
    if scale < before:
        return 0.0
    return scale / before


class _Gone:
    """The key, in a layout, of a tensor that was collected: equal to no other key."""

    __slots__ = ()


def _died(layouts: weakref.ref[ResidualLayouts], key: Hashable) -> None:
    """A watched tensor was collected (any thread, any time): mark its key for dropping."""
    owner = layouts()
    if owner is not None:
        owner._watched.discard(key)
        owner._dead.append(key)


def _put(target: Any, piece: Any) -> None:
    """Write ``piece`` into ``target``, either on the host or on a GPU (through the host where
    they are not on the same kind)."""
    if _ops.is_device_array(target) == _ops.is_device_array(piece):
        target[...] = piece
    else:
        _ops.get(target).copy_from_host(target, _ops.get(piece).to_host(piece))
