"""What /proc/cpuinfo says about this CPU (model name, ISA flags), read in one place."""
from typing import Optional, Set, Tuple


def read_cpuinfo(path: str = '/proc/cpuinfo') -> Tuple[Optional[str], Optional[Set[str]]]:
    """``(model name, flags)`` of the first CPU listed in ``path``; each None when absent or the
    file cannot be read (not Linux). Flags are x86 ``flags`` or Arm ``Features``."""
    name, flags = None, None
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(':')
                key = key.strip().lower()
                if key == 'model name' and name is None:
                    name = value.strip()
                elif key in ('flags', 'features') and flags is None:
                    flags = set(value.split())
                if name is not None and flags is not None:
                    break
    except OSError:
        pass
    return name, flags
