"""Draws the exec cost curves from the bench results.

    python3 scripts/bench-plot.py RESULTS.json OUT.png

Three panels: exec wall time against the number of images (flock(1) as the
floor), throughput against concurrent builders (stowage, flock(1), and the
0.7x target line), and the per-exec wall time under that load.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def builders_axis(ax, b, ylabel, title):
    """The x axis both load panels share: builders, log scale, one tick each."""
    if b:
        ax.set_xscale("log", base=2)
        ax.set_xticks(b, [str(x) for x in b])
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    ax.set_xlabel("concurrent builders reading one base")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)


def main(results_path, out_path):
    with open(results_path) as f:
        r = json.load(f)
    meta = r["meta"]
    series = r["series"]
    images = series.get("exec_vs_images", [])
    builders = series.get("exec_vs_builders", [])
    if not images and not builders:
        sys.exit("bench-plot: the results hold no curve (run the images and builders sections)")

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    ms = 1e3

    ax = axes[0]
    if images:
        n = [p["images"] for p in images]
        med = [p["stowage_s"] * ms for p in images]
        lo = [(p["stowage_s"] - p["stowage_p25_s"]) * ms for p in images]
        hi = [(p["stowage_p75_s"] - p["stowage_s"]) * ms for p in images]
        ax.errorbar(n, med, yerr=[lo, hi], marker="o", capsize=3, label="stowage exec --read (median, IQR)")
        ax.axhline(images[0]["flock_s"] * ms, color="gray", linestyle=":", label="flock -s (1 image)")
        ax.axhline(images[0]["stowage_s"] * 1.1 * ms, color="tab:red", linestyle="--", linewidth=1,
                   label="target: 1.1 × cost with 1 image")
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="lower right")
    ax.set_xlabel("images in the store")
    ax.set_ylabel("wall time per exec (ms)")
    ax.set_title("exec against the number of images")
    ax.grid(True, alpha=0.3)

    b = [p["builders"] for p in builders]
    ax = axes[1]
    if builders:
        ax.plot(b, [p["stowage_per_s"] for p in builders], marker="o", label="stowage exec --read")
        ax.plot(b, [p["flock_per_s"] for p in builders], marker="s", color="gray", label="flock -s")
        ax.plot(b, [0.7 * p["flock_per_s"] for p in builders], color="tab:red", linestyle="--",
                linewidth=1, label="target: 0.7 × flock(1)")
    builders_axis(ax, b, "commands completed per second", "throughput against concurrent builders")

    ax = axes[2]
    if builders:
        ax.plot(b, [p["stowage_latency_s"] * ms for p in builders], marker="o", label="stowage exec (median)")
        ax.plot(b, [p["stowage_latency_p95_s"] * ms for p in builders], marker="o", linestyle="--",
                color="tab:blue", alpha=0.5, label="stowage exec (p95)")
        ax.plot(b, [p["flock_latency_s"] * ms for p in builders], marker="s", color="gray", label="flock -s (median)")
    builders_axis(ax, b, "wall time per command (ms)", "per-command wall time under load")

    fig.suptitle(
        "stowage {} ({}): {} CPUs ({}), Linux {}, {}{}".format(
            meta.get("stowage", "?"),
            meta.get("commit") or "?",
            meta.get("cpus", "?"),
            meta.get("cpu", "?"),
            meta.get("kernel", "?"),
            meta.get("filesystem", "?"),
            ", quick run" if meta.get("options", {}).get("quick") else "",
        ),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
