"""``python -m ringcomm.perf``: the allreduce benchmark (see :mod:`ringcomm.perf`)."""

import sys

from ringcomm.perf.run import main

sys.exit(main())
