"""Communicators and their backends.

Layers (a module imports only from layers below it): ``types`` and ``launch`` at the bottom,
``base`` (the Communicator) and ``agree`` above the algorithms, and the backends (``mpi``,
``nccl``, ``threads``) on top. This package's own ``__init__`` imports nothing, so that the
bottom layer can be imported without the rest.
"""
