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
