"""L5, the backends, each a Transport and its Communicator: MPI (``mpi``, with ``staging`` for
device arrays), NCCL (``nccl`` and its ``_nccl_*`` parts), gloo over torch.distributed
(``gloo``) and in-process threads (``threads``, for tests). Which one ``ringcomm.init`` builds
is ``ringcomm.registry``'s choice."""
