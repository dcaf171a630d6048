"""Error-feedback residuals of fused buffers, kept right when the buffers are cut anew.

A fused buffer (a DDP bucket, a fusion buffer of the optimizer) holds several tensors at known
offsets, and its residual is one flat vector. When the buffers are re-cut (DDP rebuilds its
buckets after the first iteration; the optimizer re-plans when ``requires_grad`` changes), the
pieces of the old residuals move to wherever their tensors now live, so no gradient mass that
compression held back is lost or added to the wrong tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from ringcomm.codecs.feedback import ErrorFeedback

__all__ = ["Layout", "ResidualLayouts"]

#: (tensor key, offset in the buffer, number of elements) per tensor of a buffer.
Layout = tuple[tuple[Hashable, int, int], ...]


class ResidualLayouts:
    """Residuals of named fused buffers that follow their tensors across re-cuts.

    Args:
        feedback: the ErrorFeedback that stores the residuals under the buffers' names.
    """

    __slots__ = ("_layouts", "_owner", "_stash", "feedback")

    def __init__(self, feedback: ErrorFeedback) -> None:
        self.feedback = feedback
        self._layouts: dict[str, Layout] = {}
        self._owner: dict[Hashable, str] = {}
        self._stash: dict[Hashable, Any] = {}

    def align(self, name: str, layout: Layout, like: Any | Callable[[], Any]) -> None:
        """Make the residual under ``name`` match ``layout`` before a compressed call.

        Args:
            name: the buffer's name (the ErrorFeedback key).
            layout: the tensors the buffer holds now.
            like: the flat buffer as an array (the residual is created on its device, with its
                length), or a function returning it, called only if a residual is created.
        """
        if self._layouts.get(name) == layout:
            return
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
                    residual[off: off + n] = piece
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
            if residual is not None:
                self._stash[key] = residual[off: off + n].copy()
        self.feedback.reset(name)

    def piece(self, key: Hashable) -> Any | None:
        """The residual kept for one tensor (a flat float32 array), or None if it has none."""
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

    def pending(self) -> int:
        """Number of tensors whose residual waits for a buffer to hold them again."""
        return len(self._stash)
