"""The error of every checkpoint read, in a module of its own so every reader can raise it."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, unsafe to unpickle, or does not fit the model."""
