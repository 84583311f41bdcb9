"""The error of every checkpoint read, in a module of its own so every reader can raise it."""
import os.path as osp


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable, unsafe to unpickle, or does not fit the model."""


def not_a_file(name: str, path: str, head: bytes, kind: str, under: str, fresh: str = '') -> str:
    """The message for a file whose first bytes ``head`` are not of ``kind`` (a saved web page)."""
    shown = head.decode('utf-8', 'replace').replace('\n', ' ').strip()
    start = f'starts with {shown[:12]!r}...' if shown else 'is empty'
    return (f'{name} ({osp.getsize(path)} bytes) is not {kind} (it {start}). A failed download '
            f'often saves an HTML error page or a text message under {under}: download the file '
            f'again, or check the path.{fresh}')
