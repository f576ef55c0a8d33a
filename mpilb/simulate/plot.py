"""``--plot FILE.png``: epoch time and utilization against workers, or against policy."""

from __future__ import annotations

from collections import defaultdict

from mpilb.errors import UsageError


def _label(r: dict) -> str:
    return f"{r['balancer']}/{r['batch_policy']}/{r['mode']}/K={r['servers']}"


def plot_results(results: list[dict], path: str) -> None:
    """Two panels (epoch time, utilization). Several worker counts: one line per
    configuration against workers; one count: one bar per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    counts = sorted({r["workers"] for r in results})
    if len(counts) > 1:
        lines = defaultdict(list)
        for r in results:
            lines[_label(r)].append(r)
        for label, rows in lines.items():
            rows.sort(key=lambda r: r["workers"])
            xs = [r["workers"] for r in rows]
            axes[0].plot(xs, [r["epoch_s"] for r in rows], marker="o", label=label)
            axes[1].plot(xs, [r["utilization"] for r in rows], marker="o", label=label)
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("workers")
    else:
        labels = [_label(r) for r in results]
        xs = range(len(results))
        axes[0].bar(xs, [r["epoch_s"] for r in results])
        axes[1].bar(xs, [r["utilization"] for r in results])
        for ax in axes:
            ax.set_xticks(list(xs))
            ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    axes[0].set_ylabel("mean epoch time (s)")
    axes[1].set_ylabel("utilization")
    axes[1].set_ylim(0, 1.05)
    if len(counts) > 1:
        axes[1].legend(fontsize=7)
    fig.suptitle(f"mpilb simulate ({counts[0] if len(counts) == 1 else 'several'} workers)")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise UsageError(f"--plot {path}: cannot write ({exc.strerror})") from None
    finally:
        plt.close(fig)
