"""A job script for the launcher tests: each rank starts this script again as a program of its
own (``subprocess.run``), which inherits the launcher's variables and calls ringcomm.init();
the rank writes what the child printed to ``<this file>.<rank>`` (the ranks' output would
interleave), then takes part in an allreduce, which must be right."""

import subprocess
import sys

import numpy as np

import ringcomm

if sys.argv[1:] == ["child"]:
    try:
        ringcomm.init(timeout=20)
        print("joined", flush=True)
    except RuntimeError as err:
        print(f"RuntimeError: {err}", flush=True)
    sys.exit(0)
comm = ringcomm.init()
child = subprocess.run([sys.executable, __file__, "child"], capture_output=True, text=True,
                       timeout=60)
with open(f"{__file__}.{comm.rank}", "w") as f:
    f.write(f"{child.returncode} {child.stdout.strip()}")
total = comm.allreduce(np.full(3, comm.rank + 1.0, dtype=np.float32))
assert total.tolist() == [3.0, 3.0, 3.0], total
print(f"rank {comm.rank} ok", flush=True)
