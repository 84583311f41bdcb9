"""When the large-image tool reaches its peak resident set: the tool on a SIZE² BigTIFF (the
input ``large_image_tool.py`` makes), its RSS read from /proc every 0.1 s, each new high kept
with its time, so that a peak can be placed in the trunk stage or the label stage (the label
file's first tile is written when the label stage starts).

    ROOT=<checkout> OMP_NUM_THREADS=N python benchmarks/tool_rss_timeline.py CHECKPOINT TAG

Environment: ROOT, the checkout whose tool and package run (default /work/main); SIZE (4096);
CFG (UperNet S12/16's config); BUDGET (--max-memory, 1500). Writes /tmp/reg/rss_TAG.json."""
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, '/work/main/benchmarks')
root = os.environ.get('ROOT', '/work/main')
wd = '/tmp/reg'
import large_image_tool as lit  # noqa: E402

size = int(os.environ.get('SIZE', 4096))
image = lit.make_input(wd, size, size, None)
ckpt, tag = sys.argv[1], sys.argv[2]
cfg = os.environ.get('CFG', 'configs/upernet_xcit_s12_p16_160k_ade20k.py')
cmd = [sys.executable, os.path.join(root, 'tools/segment_large_image.py'),
       os.path.join(root, cfg), ckpt, image, '--out', f'{wd}/out_{tag}.tif', '--token-dir', wd,
       '--max-memory', os.environ.get('BUDGET', '1500')] + sys.argv[3:]
env = dict(os.environ, PYTHONPATH=root)
err = open(f'{wd}/err_{tag}.txt', 'w')
p = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env=env)
samples, t0, peak = [], time.time(), 0
while p.poll() is None:
    try:
        rss = int([line for line in open(f'/proc/{p.pid}/status')
                   if line.startswith('VmRSS')][0].split()[1]) // 1024
    except Exception:
        break
    with open(f'{wd}/err_{tag}.txt', 'rb') as f:
        f.seek(max(0, os.path.getsize(f.name) - 300))
        tail = f.read().decode(errors='replace')
    last = tail.replace('\r', '\n').strip().split('\n')[-1][:120]
    if rss > peak:
        peak = rss
        samples.append((round(time.time() - t0, 1), rss, last))
    time.sleep(0.1)
_, status, usage = os.wait4(p.pid, 0) if p.returncode is None else (0, 0, None)
json.dump(dict(samples=samples, peak=peak, wall=time.time() - t0),
          open(f'{wd}/rss_{tag}.json', 'w'))
print('peak', peak, 'wall', round(time.time() - t0), 'rc', p.returncode)
for s in samples[-15:]:
    print(s)
