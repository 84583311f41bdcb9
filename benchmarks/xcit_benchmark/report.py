"""What the tools print (``format_*``), the Markdown tables the docs quote, rendered from the
committed results (``markdown_*``), and a run's files."""
import os
from typing import List, Sequence

from .fresh_points import write_artifact
from .whole_model import PARTS_TRAIN

CSV_FIELDS = [
    'model', 'description', 'resolution', 'batch', 'mode', 'precision', 'device', 'threads',
    'with_cp', 'status', 'params_m', 'gmacs', 'gflop_exec', 'ms_per_img', 'ms_p25', 'ms_p75',
    'imgs_per_s', 'achieved_gflop_s', 'matmul_gflop_s', 'matmul_frac', 'peak_mem_mb',
    'mem_base_mb', 'mem_method', 'flops_counter', 'warmup', 'repeats', 'note', 'compiled',
    'compile_s']


def fmt(value, digits: int = 1) -> str:
    """``'-'`` for a missing value, a float with ``digits`` decimals, anything else as ``str``."""
    if value is None or value == '':
        return '-'
    return f'{value:.{digits}f}' if isinstance(value, float) else str(value)


def format_table(records: Sequence[dict]) -> str:
    header = (f'{"model":<28}{"res":>6}{"status":>8}{"ms/img":>10}{"img/s":>9}{"peak MB":>10}'
              f'{"GMACs":>9}{"GFLOP/s":>9}{"%mm":>6}')
    lines = [header, '-' * len(header)]
    for r in records:
        frac = r.get('matmul_frac')
        lines.append(f'{r["model"]:<28}{r["resolution"]:>6}{r["status"]:>8}'
                     f'{fmt(r.get("ms_per_img")):>10}{fmt(r.get("imgs_per_s"), 2):>9}'
                     f'{fmt(r.get("peak_mem_mb")):>10}{fmt(r.get("gmacs"), 2):>9}'
                     f'{fmt(r.get("achieved_gflop_s")):>9}'
                     f'{(f"{100 * frac:.0f}" if frac is not None else "-"):>6}')
        if r.get('note'):
            lines.append(f'    note: {r["note"]}')
        if r.get('compile_s') is not None:
            lines.append(f'    torch.compile: first call (compilation) {r["compile_s"]:.1f} s, '
                         'not in the timing')
    return '\n'.join(lines)


def format_ratios(rows: Sequence[dict]) -> str:
    """The rows of :func:`~.runner.ratio_rows` as a table."""
    header = (f'{"A":<26}{"B":<26}{"res":>6}{"A ms":>9}{"B ms":>9}{"t A/B":>7}{"paired":>8}'
              f'{"A MB":>9}{"B MB":>9}{"mem A/B":>8}')
    lines = [header, '-' * len(header)]
    for r in rows:
        lines.append(f'{r["a"]:<26}{r["b"]:<26}{r["resolution"]:>6}{fmt(r.get("a_ms")):>9}'
                     f'{fmt(r.get("b_ms")):>9}{fmt(r.get("time_ratio"), 3):>7}'
                     f'{fmt(r.get("paired_time_ratio"), 3):>8}{fmt(r.get("a_mb")):>9}'
                     f'{fmt(r.get("b_mb")):>9}{fmt(r.get("mem_ratio"), 3):>8}')
    lines.append('t A/B = ratio of the median times; paired = median of the per-round ratios of '
                 'the interleaved repeats (more robust to machine noise).')
    return '\n'.join(lines)


def md_table(header: Sequence[str], rows, align: str = '') -> str:
    """A Markdown table; ``align``: 'l' or 'r' per column (default: first left, the rest right)."""
    rule = ''.join('---|' if a == 'l' else '---:|' for a in align or 'l' + 'r' * (len(header) - 1))
    lines = ['| ' + ' | '.join(cells) + ' |' for cells in [header, *rows]]
    return '\n'.join([lines[0], '|' + rule] + lines[1:])


def markdown_goals(goals: Sequence[dict]) -> str:
    """The goals table (``meta.goals`` of a goals JSON)."""
    rows = []
    for g in goals:
        value, ok = g['value'], g['ok']
        measured = '-' if value is None else (f'**{value:.0%}**' if g['target'].endswith('%')
                                              else f'**{value:.2f}**')
        verdict = 'PASS' if ok else ('FAIL' if ok is not None else 'N/A')
        rows.append([g['goal'].replace('^2', '²'), g['target'], f'{measured} {verdict}',
                     g['detail']])
    return md_table(['goal', 'target', 'measured', 'numbers'], rows, 'llrl')


_RECORD_TABLES = (
    ('ms / image', lambda r: fmt(r.get('ms_per_img'), 0)),
    ('peak MB', lambda r: fmt(r.get('peak_mem_mb'), 0)),
    ('GMACs', lambda r: fmt(r.get('gmacs'), 1)),
    ('GFLOP/s (% of mm)', lambda r: '-' if r.get('achieved_gflop_s') is None else
     f'{r["achieved_gflop_s"]:.0f} ({100 * r["matmul_frac"]:.0f}%)'))


def markdown_records(records: Sequence[dict]) -> str:
    """One table per figure (time, memory, MACs, rate): a row per model, a column per size."""
    models = list(dict.fromkeys(r['model'] for r in records))
    resolutions = sorted({r['resolution'] for r in records})
    index = {(r['model'], r['resolution']): r for r in records}
    return '\n\n'.join(md_table([title] + [f'{res}²' for res in resolutions], [
        [f'`{model}`'] + [cell(index[(model, res)]) if (model, res) in index else '-'
                          for res in resolutions] for model in models])
        for title, cell in _RECORD_TABLES)


def markdown_flops_report(rows: Sequence[dict]) -> str:
    """The paper Table 1 comparison (``rows`` of a FLOPs report JSON)."""
    return md_table(
        ['arch', 'setting', 'trunk', 'analytic trunk', '+cls', '= classifier', 'port classifier',
         'paper', 'diff', 'params (M)', 'paper params'],
        [[r['arch'].upper(), r['setting'], f'{r["trunk_gmacs"]:.3f}',
          f'{r["analytic_trunk_gmacs"]:.3f}', f'{r["cls_part_gmacs"]:.3f}',
          f'{r["classifier_gmacs"]:.3f}', f'{r["port_classifier_gmacs"]:.3f}',
          str(r['paper_gmacs']), f'{100 * r["rel_diff"]:+.1f}%',
          f'{r["classifier_params_m"]:.2f}', str(r['paper_params_m'])] for r in rows],
        'll' + 'r' * 9)


def markdown_whole_model(data: dict) -> str:
    """A ``--whole-model`` run: per config the median step, its parts and the peak; then per
    baseline the medians (min-max) of the per-round ratios."""
    meta = data['meta']['whole_model']
    parts = [p for p in PARTS_TRAIN
             if any(p in (r.get('parts') or {}) for r in data['records'])]
    setting = f'{meta["mode"]}, {meta["shape"][0]}x{meta["shape"][1]}, batch {meta["batch"]}'
    text = md_table([setting, 'step (ms)'] + parts + ['peak RSS (MB)'], [[f'`{r["model"]}`'] + (
        [r.get('status', '?')] + ['-'] * (len(parts) + 1) if r.get('status') != 'ok' else
        [f'{r["time_ms"]:.0f}'] + [f'{r["parts"][p]["time_ms"]:.0f}' for p in parts]
        + [f'+{r["peak_mem_mb"]:.0f}']) for r in data['records']])
    ratios = data['meta'].get('ratios') or []
    if ratios:
        text += '\n\n' + md_table(['subject / baseline', 'time', 'peak memory', 'rounds'], [[
            f'`{q["subject"]}` / `{q["baseline"]}`',
            f'{q["time_ratio"]:.2f}x ({q["time_ratio_min"]:.2f}-{q["time_ratio_max"]:.2f})',
            f'{q["peak_ratio"]:.2f}x ({q["peak_ratio_min"]:.2f}-{q["peak_ratio_max"]:.2f})',
            str(q['rounds'])] for q in ratios])
    return text


def markdown_result(data: dict) -> str:
    """The Markdown tables of a stored result: FLOPs report, goals, whole-model or backbone run."""
    if 'rows' in data:
        return markdown_flops_report(data['rows'])
    if 'goals' in data.get('meta', {}):
        return markdown_goals(data['meta']['goals'])
    if 'whole_model' in data.get('meta', {}):
        return markdown_whole_model(data)
    return markdown_records(data['records'])


def write_outputs(records: Sequence[dict], meta: dict, out_dir: str, name: str,
                  plot: bool = True) -> List[str]:
    """``<name>.csv`` (:data:`CSV_FIELDS`, floats to 4 decimals), ``.json`` and ``.png``."""
    out = os.path.join(out_dir, name)
    paths = write_artifact(out, meta, records, CSV_FIELDS, 'records', [
        {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in records])
    if plot:
        plot_records(records, out + '.png', meta)
        paths.append(out + '.png')
    return paths


def log_log_axes(ax, sizes: Sequence[int], ylabel: str, title: str = '') -> None:
    """Log-log axes of a figure against the image side: a tick at each measured size."""
    from matplotlib.ticker import FuncFormatter, LogLocator
    ax.set_xscale('log', base=2)
    ax.set(yscale='log', xlim=(sizes[0] / 1.25, sizes[-1] * 1.25), xlabel='image size (px)',
           ylabel=ylabel)
    ax.set_xticks(sizes, [f'{s}²' for s in sizes])
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f'{v:g}'))
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs=()))
    ax.set_title(title, fontsize=10)
    ax.grid(True, which='major', alpha=0.3)


def plot_records(records: Sequence[dict], path: str, meta: dict):
    """ms/image and peak memory against the resolution (log-log), a line per model."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for key, ax, label in (('ms_per_img', axes[0], 'time per image (ms)'),
                           ('peak_mem_mb', axes[1], 'peak memory growth (MB)')):
        for model in dict.fromkeys(r['model'] for r in records):
            pts = sorted((r['resolution'], r[key]) for r in records
                         if r['model'] == model and r.get(key) is not None and r[key] > 0)
            failed = sorted(r['resolution'] for r in records
                            if r['model'] == model and r['status'] != 'ok')
            if not pts:
                continue
            suffix = f' ({", ".join(map(str, failed))}: OOM/failed)' if failed else ''
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker='o', label=model + suffix)
        log_log_axes(ax, sorted({r['resolution'] for r in records}), label)
        if ax.get_lines():
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, 'not measured', ha='center', va='center', transform=ax.transAxes)
    title, load = '', meta.get('loadavg_1_5_15')
    if records:
        r = records[0]
        title = (f'{r["device"]} {r["mode"]} {r["precision"]}, batch {r["batch"]}, threads='
                 f'{r["threads"]}' + (f', load {load[0]:.1f}' if load else '')
                 + f' ({meta.get("date", "")})')
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
