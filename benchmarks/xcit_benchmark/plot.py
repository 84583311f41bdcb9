"""The PNG of a run: time per image and peak memory vs input size (log-log)."""
from typing import Sequence


def default_title(meta: dict, records: Sequence[dict]) -> str:
    """Plot title: device, mode, precision, batch, threads, load and date of the run."""
    if not records:
        return ''
    r = records[0]
    load = meta.get('loadavg_1_5_15')
    load_s = f', load {load[0]:.1f}' if load else ''
    return (f'{r["device"]} {r["mode"]} {r["precision"]}, batch {r["batch"]}, '
            f'threads={r["threads"]}{load_s} ({meta.get("date", "")})')


def plot_records(records: Sequence[dict], path: str, title: str = ''):
    """Plot ms/image and peak memory vs resolution (log-log), one line per model."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    models = list(dict.fromkeys(r['model'] for r in records))
    for key, ax, label in (('ms_per_img', axes[0], 'time per image [ms]'),
                           ('peak_mem_mb', axes[1], 'peak memory growth [MB]')):
        for model in models:
            pts = sorted((r['resolution'], r[key]) for r in records
                         if r['model'] == model and r.get(key) is not None and r[key] > 0)
            failed = sorted(r['resolution'] for r in records
                            if r['model'] == model and r['status'] != 'ok')
            if not pts:
                continue
            suffix = f' ({", ".join(map(str, failed))}: OOM/failed)' if failed else ''
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker='o', label=model + suffix)
        ax.set_xscale('log', base=2)
        ax.set_yscale('log')
        resolutions = sorted({r['resolution'] for r in records})
        ax.set_xticks(resolutions)
        ax.set_xticklabels([str(r) for r in resolutions])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel('input side [px] (square input)')
        ax.set_ylabel(label)
        ax.grid(True, which='both', alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, 'not measured', ha='center', va='center', transform=ax.transAxes)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
