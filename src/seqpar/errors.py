"""The one exception type seqpar raises for bad input. Messages say what to change."""


class SeqParError(ValueError):
    """Invalid configuration or input for sequence parallelism.

    Raised before any collective is issued, so a bad input never leaves ranks hanging.
    """
