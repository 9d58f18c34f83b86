"""seqpar's exceptions: SeqParError for bad input (messages say what to change), TrainingDiverged for a
run stopped by its NaN guard."""


class SeqParError(ValueError):
    """Invalid configuration or input for sequence parallelism.

    Raised before any collective is issued, so a bad input never leaves ranks hanging.
    """


class TrainingDiverged(RuntimeError):
    """The run stopped because its loss / gradient norm stayed non-finite (`seqpar train` exits with 1)."""
