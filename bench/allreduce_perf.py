"""The allreduce benchmark, run from the source tree: the same as ``ringcomm-perf`` (and
``python -m ringcomm.perf``), which ships with the package; see :mod:`ringcomm.perf`.

    .venv/bin/mpiexec -n 2 .venv/bin/python bench/allreduce_perf.py -b 4K -e 256M -f 4
"""

from __future__ import annotations

import sys

from ringcomm.perf.run import main

if __name__ == "__main__":
    sys.exit(main())
