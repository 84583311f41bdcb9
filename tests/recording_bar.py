"""A tqdm bar for the tests of the large-image tool's progress: it draws (to nowhere) even off a
terminal and records what a person would see at each refresh."""
import io

import tqdm


def recording_bar(records: list) -> type:
    """A ``tqdm.tqdm`` subclass appending (description, unit, count, total) to ``records`` at
    each refresh."""

    class Bar(tqdm.tqdm):

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **dict(kwargs, disable=False, file=io.StringIO()))

        def refresh(self, *args, **kwargs):
            records.append((self.desc, self.unit, self.n, self.total))
            return super().refresh(*args, **kwargs)

    return Bar
