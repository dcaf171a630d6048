"""L4, the Communicator (``base``): argument checks, the cross-rank agreement on every call
(``agree``, ``_plan``, ``settings``), the choice between the flat and the two-level allreduce
(``_twolevel``, ``topology``), and what every backend's Transport shares (``transport``).
Above the algorithms, below the backends that implement the Transport."""
