"""Text tables, Markdown tables (for docs/benchmark.md) and the CSV/JSON/PNG files of a run.

The ``format_*`` functions return the text the tools print; the ``markdown_*`` functions render
a stored result (``docs/benchmark/*.json``) as the tables docs/benchmark.md quotes, so that the
docs carry figures of committed artifacts only (tests/test_benchmark.py checks it).
"""
import csv
import json
import os
from typing import List, Optional, Sequence

from .plot import default_title, plot_records
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
    if isinstance(value, float):
        return f'{value:.{digits}f}'
    return str(value)


def verdict(ok: Optional[bool]) -> str:
    """PASS / FAIL / N/A (not measured)."""
    return 'PASS' if ok else ('FAIL' if ok is not None else 'N/A')


# --------------------------------------------------------------------------------------------
# text
# --------------------------------------------------------------------------------------------
def format_table(records: Sequence[dict]) -> str:
    """A human readable table of the records."""
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
    """The rows of :func:`~.compare.ratio_rows` as a table."""
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


def format_goals(goals: Sequence[dict]) -> str:
    """The PASS/FAIL table of :func:`~.goals.run_goals`."""
    return '\n'.join(f'{verdict(g["ok"]):<5} {g["goal"]:<62} {fmt(g["value"], 3):>7} '
                     f'(target {g["target"]}) {g["detail"]}' for g in goals)


def format_flops_report(rows: Sequence[dict]) -> str:
    """:func:`~.flops.flops_report` rows as a table."""
    header = (f'{"arch":<5}{"setting":>9}{"trunk":>9}{"analytic":>9}{"+cls":>7}{"= clsfr":>9}'
              f'{"port":>9}{"paper":>8}{"diff":>8}{"":>6}{"params":>8}{"paper":>8}')
    lines = ['GMACs per image (= paper "GFLOPs"); trunk = XCiTBackbone.forward_trunk, '
             '+cls = 2 class-attention layers + norm + head (mmpretrain modules)',
             header, '-' * len(header)]
    for r in rows:
        lines.append(f'{r["arch"]:<5}{r["setting"]:>9}{r["trunk_gmacs"]:>9.3f}'
                     f'{r["analytic_trunk_gmacs"]:>9.3f}{r["cls_part_gmacs"]:>7.3f}'
                     f'{r["classifier_gmacs"]:>9.3f}{r["port_classifier_gmacs"]:>9.3f}'
                     f'{r["paper_gmacs"]:>8.2f}{100 * r["rel_diff"]:>7.1f}%'
                     f'{verdict(r["ok"]):>6}'
                     f'{r["classifier_params_m"]:>8.2f}{r["paper_params_m"]:>8.2f}')
    return '\n'.join(lines)


def format_model_flops(rows: Sequence[dict]) -> str:
    """Per-point FLOPs rows (``model``, ``resolution``, ``mode`` + :func:`~.flops.point_flops`)."""
    header = (f'{"model":<28}{"res":>6}{"mode":>10}{"params M":>10}{"GMACs":>10}'
              f'{"GFLOP exec":>12}')
    lines = [header, '-' * len(header)]
    for r in rows:
        lines.append(f'{r["model"]:<28}{r["resolution"]:>6}{r["mode"]:>10}'
                     f'{r["params_m"]:>10.2f}{r["gmacs"]:>10.3f}{r["gflop_exec"]:>12.3f}')
    lines.append('GMACs = forward multiply-accumulates per image (the papers\' "GFLOPs"); '
                 'GFLOP exec = 2 per MAC of everything the call executes (train: + backward).')
    return '\n'.join(lines)


# --------------------------------------------------------------------------------------------
# Markdown (the tables of docs/benchmark.md, rendered from the committed JSON files)
# --------------------------------------------------------------------------------------------
def _md_row(cells: Sequence[str]) -> str:
    return '| ' + ' | '.join(cells) + ' |'


def _sq(text: str) -> str:
    return text.replace('^2', '²')


def markdown_goals(goals: Sequence[dict]) -> str:
    """The goals table (``meta.goals`` of a goals JSON)."""
    lines = ['| goal | target | measured | numbers |', '|---|---|---:|---|']
    for g in goals:
        value = g['value']
        if value is None:
            measured = '-'
        elif g['target'].endswith('%'):
            measured = f'**{value:.0%}**'
        else:
            measured = f'**{value:.2f}**'
        lines.append(_md_row([_sq(g['goal']), g['target'], f'{measured} {verdict(g["ok"])}',
                              g['detail']]))
    return '\n'.join(lines)


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
    tables = []
    for title, cell in _RECORD_TABLES:
        lines = [_md_row([title] + [f'{res}²' for res in resolutions]),
                 '|---|' + '---:|' * len(resolutions)]
        for model in models:
            lines.append(_md_row([f'`{model}`'] + [
                cell(index[(model, res)]) if (model, res) in index else '-'
                for res in resolutions]))
        tables.append('\n'.join(lines))
    return '\n\n'.join(tables)


def markdown_flops_report(rows: Sequence[dict]) -> str:
    """The paper Table 1 comparison (``rows`` of a FLOPs report JSON)."""
    lines = ['| arch | setting | trunk | analytic trunk | +cls | = classifier | port classifier '
             '| paper | diff | params (M) | paper params |',
             '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
    for r in rows:
        lines.append(_md_row([
            r['arch'].upper(), r['setting'], f'{r["trunk_gmacs"]:.3f}',
            f'{r["analytic_trunk_gmacs"]:.3f}', f'{r["cls_part_gmacs"]:.3f}',
            f'{r["classifier_gmacs"]:.3f}', f'{r["port_classifier_gmacs"]:.3f}',
            str(r['paper_gmacs']), f'{100 * r["rel_diff"]:+.1f}%',
            f'{r["classifier_params_m"]:.2f}', str(r['paper_params_m'])]))
    return '\n'.join(lines)


def markdown_whole_model(data: dict) -> str:
    """A ``--whole-model`` run: per config the median step and its parts (ms) and the peak RSS
    growth; then, per baseline, the medians (min-max) of the per-round ratios."""
    meta = data['meta']['whole_model']
    parts = [p for p in PARTS_TRAIN
             if any(p in (r.get('parts') or {}) for r in data['records'])]
    setting = f'{meta["mode"]}, {meta["shape"][0]}x{meta["shape"][1]}, batch {meta["batch"]}'
    lines = [_md_row([setting, 'step (ms)'] + parts + ['peak RSS (MB)']),
             '|---|' + '---:|' * (len(parts) + 2)]
    for r in data['records']:
        if r.get('status') != 'ok':
            lines.append(_md_row([f'`{r["model"]}`', r.get('status', '?')] +
                                 ['-'] * (len(parts) + 1)))
            continue
        lines.append(_md_row([f'`{r["model"]}`', f'{r["time_ms"]:.0f}'] +
                             [f'{r["parts"][p]["time_ms"]:.0f}' for p in parts] +
                             [f'+{r["peak_mem_mb"]:.0f}']))
    ratios = data['meta'].get('ratios') or []
    if ratios:
        lines += ['', '| subject / baseline | time | peak memory | rounds |',
                  '|---|---:|---:|---:|']
        for q in ratios:
            lines.append(_md_row([
                f'`{q["subject"]}` / `{q["baseline"]}`',
                f'{q["time_ratio"]:.2f}x ({q["time_ratio_min"]:.2f}-{q["time_ratio_max"]:.2f})',
                f'{q["peak_ratio"]:.2f}x ({q["peak_ratio_min"]:.2f}-{q["peak_ratio_max"]:.2f})',
                str(q['rounds'])]))
    return '\n'.join(lines)


def markdown_result(data: dict) -> str:
    """The Markdown tables of a stored result: a FLOPs report (``rows``), a goals run
    (``meta.goals``: the goals table), a whole-model run (``meta.whole_model``) or a backbone
    benchmark run (``records``)."""
    if 'rows' in data:
        return markdown_flops_report(data['rows'])
    if 'goals' in data.get('meta', {}):
        return markdown_goals(data['meta']['goals'])
    if 'whole_model' in data.get('meta', {}):
        return markdown_whole_model(data)
    return markdown_records(data['records'])


# --------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------
def write_outputs(records: Sequence[dict], meta: dict, out_dir: str, name: str,
                  plot: bool = True, title: str = '') -> List[str]:
    """Write ``<name>.csv``, ``<name>.json`` and (optionally) ``<name>.png`` under ``out_dir``.

    Returns:
        list: The written paths.
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    csv_path = os.path.join(out_dir, f'{name}.csv')
    with open(csv_path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction='ignore')
        writer.writeheader()
        for r in records:
            writer.writerow({k: (round(v, 4) if isinstance(v, float) else v)
                             for k, v in r.items() if k in CSV_FIELDS})
    paths.append(csv_path)
    json_path = os.path.join(out_dir, f'{name}.json')
    with open(json_path, 'w') as f:
        json.dump(dict(meta=meta, records=list(records)), f, indent=1, default=str)
    paths.append(json_path)
    if plot:
        png_path = os.path.join(out_dir, f'{name}.png')
        plot_records(records, png_path, title or default_title(meta, records))
        paths.append(png_path)
    return paths


def write_rows(rows: Sequence[dict], meta: dict, out_dir: str, name: str) -> List[str]:
    """Write ``<name>.csv`` (columns: the keys of the first row) and ``<name>.json``
    (``{"meta": meta, "rows": rows}``), as the FLOPs report does.

    Returns:
        list: The written paths.
    """
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, f'{name}.csv')
    with open(csv_path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    json_path = os.path.join(out_dir, f'{name}.json')
    with open(json_path, 'w') as f:
        json.dump(dict(meta=meta, rows=list(rows)), f, indent=1)
    return [csv_path, json_path]
