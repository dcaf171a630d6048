"""What compression a user picks, in one place: the compressors (stateless: ``ringcomm.codecs``),
error feedback (stateful) and ``Auto`` (``ringcomm.algorithms.auto``). Also on ``ringcomm``
itself."""

from ringcomm.algorithms.auto import Auto, LinkModel
from ringcomm.codecs.base import Compressor, DenseCompressor
from ringcomm.codecs.cast import BF16, FP16
from ringcomm.codecs.feedback import ErrorFeedback
from ringcomm.codecs.int8 import Int8
from ringcomm.codecs.topk import TopK

__all__ = [
    "BF16",
    "FP16",
    "Auto",
    "Compressor",
    "DenseCompressor",
    "ErrorFeedback",
    "Int8",
    "LinkModel",
    "TopK",
]
