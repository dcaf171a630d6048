"""``hvd.DistributedOptimizer``: gradients averaged over ranks while backward is still running.

Each parameter's gradient hook counts it ready; as soon as every gradient of a fusion bucket
is ready, that bucket's allreduce is submitted under the bucket's name (for CUDA parameters;
on CPU, where the ring would compete with backward for the same cores, at ``step()``). Buckets
are matched across ranks by name, so the order in which backward reaches them may differ from
rank to rank (dynamic graphs). ``step()`` (or ``synchronize()``) submits whatever is left,
including parameters for which this rank computed no gradient (as zeros, so other ranks do not
wait), and waits for everything. Sparse gradients are reduced by allgather of their entries,
unless ``sparse_as_dense``; a sparse gradient that some ranks have and others lack (an
embedding used by some ranks only) is the exception to those zeros, as in Horovod: the ranks'
buckets then differ and stall, every rank's error saying so (``sparse_as_dense=True`` reduces
it as the others' zeros).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ringcomm.codecs.feedback import ErrorFeedback
from ringcomm.core.digest import fingerprint
from ringcomm.torch._errors import HorovodInternalError
from ringcomm.torch._residuals import ResidualLayouts, check_grad_scaler, rescaling
from ringcomm.torch.compression import Compression, NoneCompressor, RingCompressor, as_compression
from ringcomm.torch.horovod._basics import (
    Average,
    ReduceOp,
    communicator_of,
    global_process_set,
)
from ringcomm.torch.horovod._fusion import Bucket, Reduction, fusion_threshold, plan_buckets
from ringcomm.torch.horovod._negotiate import enqueue
from ringcomm.torch.horovod._ops import JOINED_RUNS, Op, ReduceSpec, describe
from ringcomm.torch.horovod._reduce import parse_op
from ringcomm.torch.horovod.functions import (
    _reduce_op,
    sparse_allreduce_async,
    synchronize,
)

__all__ = ["DistributedOptimizer", "base_step"]

_TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before "
                    "call to step(). Increase backward_passes_per_step to accumulate gradients "
                    "locally.")
_STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). The gradients synchronize() reduced are not "
                    "reduced again (Horovod's step() reduces them again). You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code.")
_ZERO_GRAD = ("optimizer.zero_grad() was called after loss.backward() but before "
              "optimizer.step() or optimizer.synchronize(). This is prohibited as it can cause a "
              "race condition.")


def _names(optimizer: torch.optim.Optimizer, named_parameters: Any) -> dict[Any, str]:
    """Map every parameter of ``optimizer`` to its name, with Horovod's checks."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, g in enumerate(optimizer.param_groups)
                for j, p in enumerate(g["params"])}
    named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    dups = sorted(k for k, count in Counter(k for k, _ in named).items() if count > 1)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(dups))
    named_ids = {id(v) for _, v in named}
    unnamed = [id(p) for g in optimizer.param_groups for p in g["params"] if id(p) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were "
                         "not named. Python object ids: " + ", ".join(map(str, unnamed)))
    return {v: k for k, v in named}


if TYPE_CHECKING:
    # A mixin: DistributedOptimizer makes a class with it first and the optimizer's class after.
    _OptimizerMixin = torch.optim.Optimizer
else:
    _OptimizerMixin = object


def _plan_key(active: list[Any]) -> tuple[Any, ...]:
    """What the fused buckets are cut from: each parameter that takes a gradient, with its
    dtype, device and shape. A bucket fuses one dtype and device; kept after a cast, it would
    reduce the cast parameters' gradients in the old dtype (float32 gradients through a float16
    buffer, Inf above 65504), on every rank alike."""
    # get_device() (-1 on the host) and the torch.Size: half the time of device and a tuple
    return tuple((id(p), p.dtype, p.get_device(), p.shape) for p in active)


class _DistributedOptimizer(_OptimizerMixin):
    """The methods DistributedOptimizer adds to the class of the optimizer it wraps."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: dict[Any, str],
                 compression: Any, passes: int, op: ReduceOp, predivide: float,
                 threshold: int, sparse_as_dense: bool, overlap: bool | None,
                 process_set: Any) -> None:
        try:
            super().__init__(optimizer.param_groups, **optimizer.defaults)
        except TypeError:  # an optimizer whose defaults are not its constructor's arguments
            # The next class is the wrapped optimizer's, whose constructor may take params only.
            super().__init__(optimizer.param_groups)  # type: ignore[call-arg]
        self.defaults = optimizer.defaults
        self.state.update(optimizer.state)
        self._parameter_names = names
        self._compression = compression
        self.backward_passes_per_step = passes
        self.op, self.gradient_predivide_factor = op, predivide
        self._threshold = threshold
        self._sparse_as_dense = bool(sparse_as_dense)
        self._overlap = overlap
        self._process_set = process_set
        member = process_set.included() if process_set is not global_process_set else True
        # A rank outside the process set reduces nothing: it steps on its own gradients.
        self._comm = communicator_of(process_set) if member else None
        ring = compression.ring if isinstance(compression, RingCompressor) else None
        feedback = ring is not None and compression.error_feedback
        custom = None if isinstance(compression, NoneCompressor) else compression
        pre, post = (1.0 / predivide, predivide) if op is Average else (1.0, 1.0)
        self._residuals = ResidualLayouts(ErrorFeedback()) if feedback else None
        # Compressing optimizers are numbered in the order they are made (the same on every
        # rank): a joined rank finds by it which one's buckets the others reduce.
        self._owner = f"optimizer{next(_COMPRESSING)}" if ring is not None else ""
        self._reduction = Reduction(self._comm, op, pre, post, custom, ring, self._residuals)
        self._hooked: set[int] = set()
        self._planned: tuple[Any, ...] | None = None
        self._buckets: list[Bucket] = []
        self._bucket_of: dict[Any, Bucket] = {}
        self._delay: dict[Any, int] = {}
        self._handles: list[Any] = []
        self._submitted: set[int] = set()
        self._densified: list[Any] = []  # sparse gradients reduced dense this step
        # Gradients a Horovod-style compressor reduces this step: (gradient, result, its ctx).
        self._decompressing: list[tuple[Any, Any, Any]] = []
        self._fresh = True
        self._synchronized = False
        self._should_synchronize = True
        self._warned = False
        self._grad_scaler: Any = None  # set by DistributedOptimizer
        self._scale: float | None = None  # the loss scale the residuals are in
        self._lock = threading.Lock()
        if self._comm is not None and self._comm.size > 1:  # else no hooks (as Horovod)
            active = [p for p in reversed(self._all_parameters()) if p.requires_grad]
            self._plan(active, _plan_key(active))

    # ---------------------------------------------------------------------- planning
    def _all_parameters(self) -> list[Any]:
        return [p for g in self.param_groups for p in g["params"]]

    def _begin_round(self) -> None:
        """Start counting gradients of a new step; re-plan if ``requires_grad`` changed, or a
        parameter's dtype, device or shape (``module.half()``, ``.to(...)`` and assigning
        ``.data`` keep the Parameter objects)."""
        active = [p for p in reversed(self._all_parameters()) if p.requires_grad]
        key = _plan_key(active)
        if key != self._planned:
            self._plan(active, key)
        for b in self._buckets:
            b.ready = 0
        if self._grad_scaler is not None and self._residuals is not None:
            self._follow_scale(self._residuals)
        self._delay = dict.fromkeys(self._bucket_of, self.backward_passes_per_step)
        self._handles, self._submitted, self._fresh = [], set(), False
        self._decompressing = []

    def _follow_scale(self, residuals: ResidualLayouts) -> None:
        """Rescale the residuals by new loss scale / old where the grad scaler's changed (at a
        step's first gradient: the last step's reductions are over)."""
        scale = float(self._grad_scaler.get_scale())
        factor, self._scale = rescaling(self._scale, scale), scale
        if factor is not None:
            residuals.scale(factor)

    def _plan(self, active: list[Any], key: tuple[Any, ...]) -> None:
        custom = self._reduction.compression is not None and self._reduction.ring is None
        # Custom compressors change each tensor on its own, so their gradients are not fused.
        threshold = 0 if custom else self._threshold
        self._buckets = plan_buckets(active, self._parameter_names, threshold)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._planned = key
        me = weakref.ref(self)
        if self._reduction.ring is not None:  # a joined rank's part in each bucket
            for b in self._buckets:
                JOINED_RUNS[self._owner, b.name] = functools.partial(_joined_bucket, me, b)

        def hook(t: torch.Tensor) -> None:
            opt = me()  # weak: the parameters must not keep the optimizer alive
            if opt is not None:
                opt.grad_ready(t)

        for p in active:
            if id(p) not in self._hooked:
                p.register_post_accumulate_grad_hook(hook)
                self._hooked.add(id(p))

    # ---------------------------------------------------------------------- reduction
    def grad_ready(self, p: Any) -> None:
        """Count parameter ``p``'s gradient as accumulated (its hook calls this), starting its
        bucket's allreduce once the bucket is complete (at once where it overlaps backward)."""
        # Backward may call hooks from one thread per device.
        with self._lock:
            self._count(p)

    def _count(self, p: Any) -> None:
        if self._fresh:
            self._begin_round()
        bucket = self._bucket_of.get(p)
        if bucket is None:
            return
        if self._delay[p] <= 0:
            raise AssertionError(_TOO_MANY_PASSES)
        self._delay[p] -= 1
        if self._delay[p] == 0:
            bucket.ready += 1
            if bucket.ready == len(bucket.params) and self._overlaps(bucket):
                self._submit(bucket)

    def _overlaps(self, bucket: Bucket) -> bool:
        """Whether a bucket is submitted as soon as it is ready (else at synchronize)."""
        if self._overlap is not None:
            return self._overlap
        return bucket.params[0].device.type == "cuda"

    def _submit(self, bucket: Bucket) -> None:
        self._submitted.add(id(bucket))
        grads: list[torch.Tensor] = []
        for p in bucket.params:
            grad = p.grad
            if grad is None:
                # Another rank may have a gradient for it: reduce zeros rather than hang it.
                grad = p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif grad.is_sparse and self._sparse_as_dense:
                # Reduced dense, handed back sparse (as Horovod): optimizers such as
                # SparseAdam take sparse gradients only.
                self._densified.append(p)
                grad = p.grad = grad.to_dense()
            grads.append(grad)
        if any(g.is_sparse for g in grads):
            self._submit_apart(bucket, grads)
            return
        if self._reduction.ring is None and self._reduction.compression is not None:
            self._submit_custom(bucket, grads[0])
            return
        grad = grads[0]
        meta = {"dtype": str(grad.dtype), "device": grad.device.type,
                "shape": (bucket.numel,), **self._fields(bucket)}
        if self._reduction.ring is not None:
            meta["owner"] = self._owner  # which optimizer a joined rank runs it with
        op = Op("allreduce", bucket.name, meta, lambda comm: self._reduction(bucket),
                nbytes=bucket.numel * grad.element_size(), process_set=self._process_set)
        self._handles.append((None, enqueue(op)))

    def _fields(self, bucket: Bucket) -> dict[str, Any]:
        """What every rank's reduction of ``bucket`` agrees on besides its tensor."""
        return {"op": self.op.name, "prescale": self._reduction.prescale,
                "postscale": self._reduction.postscale,
                "compression": type(self._compression).__name__,
                "parameters": fingerprint(bucket.layout), "bucket": True,
                "backward_passes_per_step": self.backward_passes_per_step}

    def _submit_custom(self, bucket: Bucket, grad: torch.Tensor) -> None:
        """A bucket (of one parameter) under a Horovod-style compressor, as Horovod reduces it:
        the gradient compressed here, what ``compress`` gave allreduced as any tensor (so a
        rank that has joined takes part with zeros of its dtype and shape), and decompressed
        into the gradient by :meth:`synchronize`."""
        red = self._reduction
        compressed, ctx = red.compression.compress(grad)
        out = torch.empty_like(compressed, memory_format=torch.contiguous_format)
        meta = {**describe(compressed), **self._fields(bucket)}
        op = Op("allreduce", bucket.name, meta,
                reduce=ReduceSpec(compressed, out, self.op, red.prescale, red.postscale),
                nbytes=compressed.numel() * compressed.element_size(),
                process_set=self._process_set)
        self._handles.append((None, enqueue(op)))
        self._decompressing.append((grad, out, ctx))

    def _submit_apart(self, bucket: Bucket, grads: list[torch.Tensor]) -> None:
        """A bucket holding a sparse gradient: each gradient (``grads``, of the bucket's
        parameters) reduced on its own, the sparse ones by allgather of their entries
        (Horovod's default for sparse gradients)."""
        red = self._reduction
        for p, grad, (name, _, _) in zip(bucket.params, grads, bucket.layout, strict=True):
            if grad.is_sparse:
                self._handles.append((p, sparse_allreduce_async(
                    grad, name, self.op, process_set=self._process_set)))
            else:  # marked as the optimizer's, so that a stall says why buckets differ
                op = _reduce_op(grad, grad, name, self.op, red.prescale, red.postscale, None,
                                self._process_set)
                op.meta["bucket"] = True
                self._handles.append((None, enqueue(op)))

    def synchronize(self) -> None:
        """Finish reducing every gradient (starting those not started yet); wait for them.

        Raises:
            HorovodInternalError: a reduction failed (on every rank); the others are waited for.
        """
        if self._comm is not None and self._comm.size > 1:
            if self._fresh:
                self._begin_round()
            for bucket in self._buckets:
                if id(bucket) not in self._submitted:
                    self._submit(bucket)
            errors = []
            for p, handle in self._handles:
                try:
                    if p is None:
                        synchronize(handle)
                    else:
                        p.grad = handle()
                except Exception as err:
                    errors.append(err)
            if not errors:  # into the gradients, before the densified ones turn sparse again
                for grad, out, ctx in self._decompressing:
                    grad.copy_(self._reduction.compression.decompress(out, ctx))
            for p in self._densified:
                p.grad = p.grad.to_sparse()
            self._fresh, self._handles, self._densified = True, [], []
            self._decompressing = []
            if errors:
                raise errors[0]
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Make ``step()`` inside the block skip synchronizing (call ``synchronize()`` first).

        Example::

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Synchronize the gradients (unless inside ``skip_synchronize()``), then step."""
        if self._should_synchronize:
            if self._synchronized and not self._warned:
                self._warned = True
                warnings.warn(_STEP_AFTER_SYNC, stacklevel=2)
            # Gradients that synchronize() reduced, with no backward since, are not reduced
            # again (Horovod's step() reduces them again): where some ranks alone called
            # synchronize() first (rank 0 logging the gradient norm), that second round
            # paired with the other ranks' next step, mixing two steps' gradients without
            # a word, or waited for them until the stall limit.
            if not (self._synchronized and self._fresh):
                self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (as ``torch.optim.Optimizer.add_param_group``); its
        parameters that ``named_parameters`` did not name are named as Horovod names unnamed
        ones (``allreduce.noname.<group>.<index>``) and reduced from the next backward on."""
        super().add_param_group(param_group)
        names = getattr(self, "_parameter_names", None)
        if names is None:  # the optimizer's own constructor, before this one's state
            return
        group = len(self.param_groups) - 1
        for j, p in enumerate(self.param_groups[-1]["params"]):
            names.setdefault(p, f"allreduce.noname.{group}.{j}")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (not allowed between backward and step/synchronize)."""
        if not self._fresh:
            raise AssertionError(_ZERO_GRAD)
        return super().zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated before gradients are reduced."""
        self.backward_passes_per_step = _check_passes(passes)
        self._delay = dict.fromkeys(self._delay, passes)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load optimizer state; any reduction in progress is forgotten."""
        self._handles, self._fresh, self._synchronized = [], True, False
        self._decompressing = []
        self._should_synchronize = True
        return super().load_state_dict(state_dict)


_COMPRESSING = itertools.count()


def _joined_bucket(opt_ref: weakref.ref[_DistributedOptimizer], bucket: Bucket, comm: Any,
                   meta: dict[str, Any]) -> None:
    """A joined rank's part in a compressed bucket the others reduce: zero gradients through
    the optimizer's own reduction (the same compression, name and error feedback, whose
    residual goes out with them); its gradients are left as they were."""
    opt = opt_ref()
    if opt is None:
        raise HorovodInternalError(f"allreduce {bucket.name!r} reached a joined rank whose "
                                   "DistributedOptimizer is gone")
    saved = [p.grad for p in bucket.params]
    try:
        for p in bucket.params:
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        opt._reduction(bucket)
    finally:
        for p, g in zip(bucket.params, saved, strict=True):
            p.grad = g


def base_step(optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
    """``step()`` of the optimizer itself, without a DistributedOptimizer's reduction."""
    if isinstance(optimizer, _DistributedOptimizer):
        return super(_DistributedOptimizer, optimizer).step(closure)
    return optimizer.step(closure)


def _check_passes(passes: Any) -> int:
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
    return passes


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = global_process_set, *,
                         fusion_threshold_bytes: int | None = None,
                         overlap: bool | None = None,
                         grad_scaler: Any = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    The result is an instance of the wrapped optimizer's class (with its state and options).

    Args:
        optimizer: any torch.optim optimizer.
        named_parameters: ``model.named_parameters()``; names key the error feedback and
            appear in messages. Every parameter of the optimizer must be named.
        compression: ``hvd.Compression.<name>``, a ringcomm compressor, or a Horovod-style
            compressor. int8 and top-k keep per-parameter residuals (error feedback).
        backward_passes_per_step: backward passes accumulated locally before the gradients are
            reduced.
        op: hvd.Average (default) or hvd.Sum (also Min, Max, Product).
        gradient_predivide_factor: with Average, scale by 1/factor before the sum and by
            factor/size after it.
        num_groups: accepted for compatibility (fusion is by size here).
        groups: accepted for compatibility (fusion is by size here).
        sparse_as_dense: reduce sparse gradients as dense tensors (handed back sparse, as in
            Horovod); by default they are reduced by allgather of their entries (the result
            is sparse).
        process_set: reduce over this process set (a rank outside it steps on its own
            gradients).
        fusion_threshold_bytes: largest fused bucket (default: $HOROVOD_FUSION_THRESHOLD, else
            4 MiB).
        overlap: submit each bucket as soon as its gradients are ready, so that it is reduced
            while backward goes on (True), or at ``step()`` (False); None: at once for CUDA
            parameters only (on CPU the ring competes with backward for the cores).
        grad_scaler: the ``torch.amp.GradScaler`` the loss is scaled with (ringcomm's, not
            Horovod's): the gradients reduced are in the loss scale's units, and so are the
            residuals of error feedback; where the scale changes between steps they are
            rescaled with it at the next step's first gradient, and dropped where it fell
            (after a step the scaler skipped, whose gradients they would apply later). Without
            it a scale that grows or backs off mis-weights what compression held back.

    Raises:
        ValueError: duplicate or missing names, named_parameters not (name, tensor) pairs,
            backward_passes_per_step < 1, gradient_predivide_factor with an op other than
            Average.
        NotImplementedError: op=hvd.Adasum, or a process set other than the global one.

    Example::

        import ringcomm.torch as hvd
        hvd.init()
        opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvd.Compression.int8)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    """
    rop = parse_op(op, None)
    if process_set is not global_process_set and process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered: use hvd.add_process_set first")
    if gradient_predivide_factor != 1.0 and rop is not Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "torch.Tensor.")
    passes = _check_passes(backward_passes_per_step)
    names = _names(optimizer, named_parameters)
    comp = as_compression(compression)
    threshold = fusion_threshold(fusion_threshold_bytes)
    check_grad_scaler(grad_scaler)
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    opt = cls(optimizer, names, comp, passes, rop, float(gradient_predivide_factor), threshold,
              sparse_as_dense, overlap, process_set)
    opt._grad_scaler = grad_scaler
    return opt
