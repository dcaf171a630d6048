"""L3, collective algorithms over a Transport: the dense pipelined ring (``ring``), the
two-level allreduce (``hierarchical``), the compressed ring (``compressed_ring``), the sparse
allreduces (``sparse``), PowerSGD (``powersgd``), ``compression="auto"`` (``auto``), and the
registry of compressed allreduces by name (``compressed``). They see a Transport, never a
Communicator."""
