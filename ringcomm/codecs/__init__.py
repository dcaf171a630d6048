"""L2, codecs and error feedback: the Compressor interface (``base``), the 16-bit casts
(``cast``), int8 block quantization (``int8``), top-k sparsification (``topk``) and
:class:`~ringcomm.codecs.feedback.ErrorFeedback`. Above the array operations (``ringcomm.ops``),
below the algorithms that run them over a Transport."""
