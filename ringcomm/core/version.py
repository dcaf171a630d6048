"""ringcomm's version: the one place it is written (``pyproject.toml`` reads it from here).

Every communicator agrees on it as it starts (``ringcomm.comm.settings``): ranks running
different releases could frame, compress or reduce a call differently, so a job whose nodes
have different installs fails on every rank at start-up, naming each rank's version.
"""

__version__ = "0.1.0"
