# Copyright (c) xcit_mm contributors. All rights reserved.
"""Helpers shared by the command-line tools."""
import re

_ANSI = re.compile(r'\x1b\[[0-9;?]*[ -/]*[@-~]')


def error_line(error) -> str:
    """``error: MESSAGE`` on one line, without terminal escape codes, for a CLI's stderr.

    Messages may quote third-party text (torch's load errors carry ANSI bold codes and
    several lines); a user, a log file or a script reading stderr gets one clean line.
    """
    text = _ANSI.sub('', str(error))
    return 'error: ' + ' '.join(text.split())
