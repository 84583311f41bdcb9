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
