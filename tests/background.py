"""A test helper process that runs while other tests of its module go on (the other core)."""
import contextlib
import subprocess


@contextlib.contextmanager
def background_process(cmd, out_dir, **popen_kwargs):
    """``cmd`` started in the background, its stdout / stderr written to ``out_dir``'s
    ``stdout.txt`` / ``stderr.txt``; killed on exit if it still runs."""
    with open(out_dir / 'stdout.txt', 'w') as out, open(out_dir / 'stderr.txt', 'w') as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, **popen_kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def background_once(tmp_path_factory, name, make_cmd, timeout, **popen_kwargs):
    """``make_cmd(folder)`` started in the background once per test session, by whichever xdist
    worker asks first (a module-scoped fixture runs on each worker); returns ``wait()``: its exit
    status and ``folder`` (its ``stdout.txt``, ``stderr.txt``; its directory unless ``cwd`` is
    given), for any worker. A shell writes the status, so the run ends on its own (within
    ``timeout``) whichever worker ends first."""
    import os
    import time
    base = tmp_path_factory.getbasetemp()
    if os.environ.get('PYTEST_XDIST_WORKER'):
        base = base.parent  # the session's folder, shared by its workers
    folder = base / f'background_{name}'
    try:
        folder.mkdir()
    except FileExistsError:
        pass  # started by the other worker
    else:
        script = ('d=$1; shift; timeout "$0" "$@" >"$d/stdout.txt" 2>"$d/stderr.txt"; '
                  'echo $? >"$d/status.tmp"; mv "$d/status.tmp" "$d/status"')
        popen_kwargs.setdefault('cwd', str(folder))
        subprocess.Popen(['sh', '-c', script, str(timeout), str(folder), *make_cmd(folder)],
                         **popen_kwargs)

    def wait():
        deadline = time.time() + timeout + 30
        while not (folder / 'status').exists():
            assert time.time() < deadline, f'{name}: no exit status after {timeout} s'
            time.sleep(0.2)
        return int((folder / 'status').read_text()), folder
    return wait
