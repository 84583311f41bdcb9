"""The error of every checkpoint read: one type that the tools end in one line (``error: ...``).

Its own module so that the readers of each format (``checkpoint_io``, ``safetensors_io``) and the
load hooks (``ckpt_load``) raise it without importing one another.
"""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, unsafe to unpickle, or does not fit the model."""
