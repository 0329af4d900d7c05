"""PNG plots of benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

LATENCIES = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("e2el", "end-to-end latency (ms)"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(runs: dict[str, dict], path: Path, title: str = "") -> Path:
    """One panel per latency (TTFT, TPOT, E2E): the CDF of each run's requests."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(LATENCIES), figsize=(5 * len(LATENCIES), 4))
    for ax, (key, xlabel) in zip(axes, LATENCIES):
        for label, run in runs.items():
            values = sorted(r[key] * 1000 for r in run["requests"] if r["success"] and r[key] is not None)
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_slo_vs_rate(series: dict[str, list[tuple[float, float]]], path: Path, title: str = "",
                     goodput: bool = False) -> Path:
    """SLO attainment (%), or goodput (req/s meeting the SLO), against request rate, one line per system."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        points = sorted(points)
        ax.plot([p[0] for p in points], [p[1] * (1 if goodput else 100) for p in points], marker="o", label=label)
    ax.set_xlabel("request rate (req/s)")
    if goodput:
        ax.set_xscale("log", base=2)
        ax.set_ylabel("goodput (req/s meeting the SLO)")
    else:
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(-5, 105)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_offline(scenarios: dict[str, dict], path: Path) -> Path:
    """transformers vs ours per offline scenario: output tokens/s, with the ratio on top."""
    plt = _pyplot()
    names = list(scenarios)
    fig, ax = plt.subplots(figsize=(2.2 * len(names) + 2, 4))
    width = 0.38
    for i, name in enumerate(names):
        s = scenarios[name]
        hf, ours = s["hf"]["output_throughput"], s["ours"]["output_throughput"]
        ax.bar(i - width / 2, hf, width, color="tab:gray", label="transformers generate" if i == 0 else None)
        ax.bar(i + width / 2, ours, width, color="tab:blue", label="splitserve engine.LLM" if i == 0 else None)
        ax.text(i + width / 2, ours, f"{s['speedup_output_throughput']:.1f}x", ha="center", va="bottom")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("output tokens / s")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def slo_series(runs: dict[str, dict], key: str = "slo_attainment") -> dict[str, list[tuple[float, float]]]:
    """From runs labelled 'system@<rate>rps': (rate, metrics[key]) points per system."""
    series: dict[str, list[tuple[float, float]]] = {}
    for label, run in runs.items():
        system, _, tag = label.partition("@")
        if tag.endswith("rps") and key in run["metrics"]:
            series.setdefault(system, []).append((float(tag[:-3]), run["metrics"][key]))
    return series


def plot_compare(results: dict, out: Path) -> list[str]:
    """Every plot `bench compare` makes; returns the files written."""
    out = Path(out)
    written = []
    scenarios = results["scenarios"]
    offline = {k: v for k, v in scenarios.items() if "speedup_output_throughput" in v}
    if offline:
        written.append(plot_offline(offline, out / "offline_throughput.png"))
    for name in ("serving", "conditional"):
        if name in scenarios and scenarios[name]["runs"]:
            runs = scenarios[name]["runs"]
            written.append(plot_latency_cdfs(runs, out / f"{name}_latency_cdf.png", title=name))
            series = slo_series(runs)
            if series:
                slo = next(iter(runs.values()))["metrics"].get("slo", {})
                title = f"{name}: TTFT <= {slo.get('ttft_ms')} ms, TPOT <= {slo.get('tpot_ms')} ms"
                written.append(plot_slo_vs_rate(series, out / f"{name}_slo_vs_rate.png", title))
                written.append(plot_slo_vs_rate(slo_series(runs, "goodput"), out / f"{name}_goodput_vs_rate.png",
                                                title, goodput=True))
    return [str(p) for p in written]
