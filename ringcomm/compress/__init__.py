"""Compressors (stateless), error feedback (stateful) and compressed allreduce algorithms."""

from ringcomm.compress.auto import Auto, LinkModel
from ringcomm.compress.base import Compressor, DenseCompressor
from ringcomm.compress.cast import BF16, FP16
from ringcomm.compress.feedback import ErrorFeedback
from ringcomm.compress.int8 import Int8
from ringcomm.compress.topk import TopK

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
