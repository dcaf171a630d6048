"""The Horovod-compatible surface behind ``import ringcomm.torch as hvd``: init and shutdown,
the process's communicator and process sets, name-matched negotiation of operations, and
Horovod's collectives, optimizer, broadcasts, SyncBatchNorm and timeline.

Its names are re-exported by :mod:`ringcomm.torch`, which is what users import; the DDP hook
(:mod:`ringcomm.torch.hooks`) and the framework adapters sit beside it, above.
"""
