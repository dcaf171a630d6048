"""``import horovod.torch as hvd`` gives ``ringcomm.torch``: the one-import switch users make."""

import sys

import ringcomm.torch as _ringcomm_torch

sys.modules[__name__] = _ringcomm_torch
