"""L0, the vocabulary every layer shares: reduction ops, dtypes, stats and error types, the
Transport protocol (``types``); launcher detection (``launch``); logging (``log``); trace spans
(``trace``); environment variables (``env``). Imports nothing of ringcomm."""
