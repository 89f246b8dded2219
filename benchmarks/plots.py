"""PNG plots of a report (matplotlib, headless) and the Markdown tables of every report."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def pyplot():
    """matplotlib's pyplot on the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_label(method: str, library: str | None) -> str:
    return method if library is None else f"{method}/{library}"


def md_table(head: list[str], rows: list[list], align: str | list[str] = "---") -> list[str]:
    """A Markdown table's lines: ``head``, its rule (``align``: every column's, or one per column), ``rows``."""
    rule = "".join(f"{a}|" for a in ([align] * len(head) if isinstance(align, str) else align))
    return [f"| {' | '.join(head)} |", f"|{rule}"] + [f"| {' | '.join(map(str, r))} |" for r in rows]


def md_section(title: str, intro: str | None, table: list[str]) -> list[str]:
    """A report section's lines: a blank line, its ``## title``, ``intro`` (a paragraph) if any, ``table``."""
    return ["", f"## {title}", "", *([intro, ""] if intro else []), *table]


def plot_speedup(report: dict, path: Path) -> None:
    """Decode speedup per benchmark and method, one panel per subset."""
    plt = pyplot()
    subsets = [s for s in ("all", "calls") if any(r["subset"] == s for r in report["runs"])]
    fig, axes = plt.subplots(1, len(subsets), figsize=(7 * len(subsets), 4.5), squeeze=False)
    for ax, subset in zip(axes[0], subsets):
        rows = [r for r in report["runs"] if r["subset"] == subset and r["method"] != "ar"]
        benches = sorted({r["benchmark"] for r in rows})
        labels = list(dict.fromkeys(run_label(r["method"], r["library"]) for r in rows))
        width = 0.8 / max(len(labels), 1)
        for j, lab in enumerate(labels):
            ys = [
                next(
                    (
                        r["decode_speedup"] or 0
                        for r in rows
                        if r["benchmark"] == b and run_label(r["method"], r["library"]) == lab
                    ),
                    0,
                )
                for b in benches
            ]
            ax.bar([i + j * width for i in range(len(benches))], ys, width, label=lab)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(benches))], benches)
        ax.set_ylabel("decode speedup vs plain greedy (×)")
        ax.set_title(f"subset: {subset}")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"{report['model']} on {report['hardware'][:60]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_accepted_by_state(recs: list[dict], path: Path) -> None:
    """Accepted draft tokens per step, by the state (label) of the step, one panel per method."""
    plt = pyplot()
    per: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r in recs:
        if r["method"] == "ar":
            continue
        for lab, acc in zip(r["step_labels"], r["accepted_per_step"]):
            per[run_label(r["method"], r["library"])][lab].append(acc)
    if not per:
        return
    names = sorted(per)
    cols = min(3, len(names))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.5 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        states = sorted(per[name], key=lambda s: -len(per[name][s]))
        ax.boxplot([per[name][s] for s in states], showmeans=True)
        ax.set_xticks(
            range(1, len(states) + 1),
            [f"{s}\n(n={len(per[name][s])})" for s in states],
            fontsize=7,
            rotation=30,
            ha="right",
        )
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("accepted tokens / step")
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_mat_vs_prior(report: dict, path: Path) -> None:
    """MAT vs number of earlier calls of the same tool in the stream (what online history saw)."""
    plt = pyplot()
    data = report.get("mat_vs_prior_calls") or {}
    if not data:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    buckets = ["0", "1", "2", "3-4", "5-9", "10+"]
    for label, cells in sorted(data.items()):
        xs = [i for i, b in enumerate(buckets) if b in cells and cells[b]["mat"] is not None]
        ax.plot(
            xs, [cells[buckets[i]]["mat"] for i in xs], marker="o", label=label, ls="--" if "/cold" in label else "-"
        )
    ax.set_xticks(range(len(buckets)), buckets)
    ax.set_xlabel("earlier calls of the same tool in the stream")
    ax.set_ylabel("MAT (tokens per forward)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(report: dict, recs: list[dict], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "speedup.png", folder / "accepted_by_state.png", folder / "mat_vs_prior_calls.png"]
    plot_speedup(report, paths[0])
    plot_accepted_by_state(recs, paths[1])
    plot_mat_vs_prior(report, paths[2])
    return [p for p in paths if p.exists()]
