"""PyTorch's own distributed tests (``DistributedTest._DistTestBase``, shipped in the torch
wheel as ``torch.testing._internal.distributed.distributed_test``) on the "ringcomm" backend,
as PyTorch runs them on gloo (its test/distributed/test_distributed_spawn.py): every test
starts ``WORLD_SIZE`` fresh processes, each calling ``init_process_group("ringcomm")`` through
a file store. They are forked from a server process that imported torch and this suite once
(multiprocessing's forkserver: about 1 s a test instead of 11 on 2 cores), and so end as
multiprocessing ends forked processes, with ``os._exit``; ``RINGCOMM_TORCH_DIST_START=spawn``
spawns each instead, as PyTorch's own run does. Run by tests/upstream/run_torch_distributed.py,
which sets the environment.

PyTorch's suite states which backends a test needs through ``DistTestCases.backend_feature``;
"ringcomm" is named there for what it does: a plugin backend, DDP on CPU, and sub-groups
(which it runs on its gloo fallback). It is not named for "gpu" or "cuda".
"""

from __future__ import annotations

import multiprocessing.context
import os
from typing import Any

import torch

import ringcomm.torch  # noqa: F401  (registers "ringcomm", in every spawned process too)

os.environ.setdefault("BACKEND", "ringcomm")
os.environ.setdefault("WORLD_SIZE", "3")

from torch.testing._internal.common_distributed import DistTestCases

# Before distributed_test is imported: its decorators read these sets as its classes are made.
for feature in ("plugin", "ddp", "subgroup"):
    DistTestCases.backend_feature[feature].add("ringcomm")

import torch.distributed as dist  # noqa: E402
import torch.testing._internal.distributed.distributed_test as _upstream  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)


class _ForkServerProcess(multiprocessing.context.ForkServerProcess):
    """A process forked from a server that imported torch and this suite once.

    The same fresh process as spawn's (the server has run nothing but imports, and each test's
    processes set their backend up afresh), without paying seconds to import torch again. It
    runs in the environment of the test that started it (PyTorch's tests give each test a
    directory of its own through ``TEMP_DIR``), not in the server's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._environ = dict(os.environ)

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environ)
        super().run()


class TestRingcommBackend(TestDistBackend, DistributedTest._DistTestBase):
    """Each of PyTorch's distributed tests, its processes started afresh."""

    def setUp(self) -> None:
        super().setUp()
        if os.environ.get("RINGCOMM_TORCH_DIST_START", "forkserver") == "spawn":
            self._spawn_processes()
        else:
            multiprocessing.set_forkserver_preload([__name__])
            self._start_processes(_ForkServerProcess)

    # PyTorch runs its CPU all_to_all_single tests on MPI alone (a condition on the backend's
    # name); the ringcomm backend runs all_to_all_single on its communicator, so PyTorch's own
    # helpers of those tests run here on it as well.
    def test_ringcomm_all_to_all_single_equal_split(self) -> None:
        self._test_all_to_all_single_equal_split_helper(*self._init_global_test())

    def test_ringcomm_all_to_all_single_equal_split_complex(self) -> None:
        self._test_all_to_all_single_equal_split_helper(*self._init_global_test(),
                                                        dtype=torch.cfloat)

    def test_ringcomm_all_to_all_single_unequal_split(self) -> None:
        self._test_all_to_all_single_unequal_split_helper(*self._init_global_test())

    def test_ringcomm_all_to_all_single_unequal_split_complex(self) -> None:
        self._test_all_to_all_single_unequal_split_helper(*self._init_global_test(),
                                                          dtype=torch.cfloat)

    def test_ringcomm_all_to_all_single_equal_split_group(self) -> None:
        self._test_all_to_all_single_equal_split_helper(*self._init_group_test())

    def test_ringcomm_all_to_all_single_unequal_split_group(self) -> None:
        self._test_all_to_all_single_unequal_split_helper(*self._init_group_test())

    def test_ringcomm_all_to_all_single_equal_split_full_group(self) -> None:
        self._test_all_to_all_single_equal_split_helper(*self._init_full_group_test())

    def test_ringcomm_all_to_all_single_unequal_split_full_group(self) -> None:
        self._test_all_to_all_single_unequal_split_helper(*self._init_full_group_test())


# PyTorch reserves some CPU tests for gloo by the backend's name: ``require_backend_is_available``
# with a set that holds "gloo" (DDP's behaviour with unused parameters, control flow that
# differs between ranks, the object collectives, all_reduce_coalesced), and conditions on
# ``BACKEND`` for the tests named in _BY_NAME. The ringcomm backend serves every CPU collective
# gloo serves, with futures and timeouts, so each runs here on it too, under its own name:
# PyTorch's test as it is, only not skipped for the backend's name; its other conditions (GPUs,
# world sizes) still apply. Not monitored_barrier's: torch.distributed.monitored_barrier itself
# refuses every backend but gloo. The tests in _CPU_BRANCH_OF_GLOO choose their CPU set-up by
# the backend's name too (``if BACKEND == "mpi" or BACKEND == "gloo"``): their body sees "gloo"
# there (the group is ringcomm's all the same).
_GLOO_GATE = f"Test requires backend {os.environ['BACKEND']} to be one of "
_BY_NAME = (
    # "get_future is only supported on mpi, nccl and gloo"
    "test_get_future", "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    # "Only Gloo backend supports sparse all reduce"
    "test_sparse_all_reduce_sum",
    # "Only gloo backend supports timeouts" (test_barrier_timeout_global also needs file://)
    "test_barrier_timeout_group", "test_barrier_timeout_full_group",
    # "GLOO Batch Send Recv CPU"
    "test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags",
)
# Not "Only MPI supports all_to_all": all_to_all's list form reaches the group's gloo backend
# from PyTorch's C++, and gloo refuses the tensors of different sizes those tests pass
# ("ProcessGroupGloo::alltoall: invalid tensor size"), as on a gloo group.
_CPU_BRANCH_OF_GLOO = tuple(name for name in _BY_NAME
                            if name.startswith("test_accumulate_gradients_no_sync"))


def _gated_for_gloo(name: str, test: Any) -> bool:
    why = getattr(test, "__unittest_skip_why__", "")
    if not getattr(test, "__unittest_skip__", False) or "monitored_barrier" in name:
        return False
    return name in _BY_NAME or (why.startswith(_GLOO_GATE) and "'gloo'" in why)


def _ungated(name: str, test: Any) -> Any:
    def run(self: TestRingcommBackend) -> None:
        if name not in _CPU_BRANCH_OF_GLOO:
            test(self)
            return
        assert dist.get_backend() == "ringcomm"
        _upstream.BACKEND = "gloo"
        try:
            test(self)
        finally:
            _upstream.BACKEND = os.environ["BACKEND"]

    run.__name__ = run.__qualname__ = name
    run.__doc__ = test.__doc__
    return run


for _name in dir(DistributedTest._DistTestBase):
    _test = getattr(DistributedTest._DistTestBase, _name)
    if _name.startswith("test_") and _gated_for_gloo(_name, _test):
        setattr(TestRingcommBackend, _name, _ungated(_name, _test))
