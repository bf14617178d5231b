"""Throughput against concurrency for every client of ``peers.py``, from its results.

    python benchmarks/plot_peers.py [--results benchmarks/results/peers.json] [--out docs/img/peers_throughput.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "peers.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--out", default="docs/img/peers_throughput.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(args.results).read_text())["median"]
    levels = [("sequential", 1), ("c64", 64), ("c256", 256)]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for client, figures in data.items():
        xs = [c for key, c in levels if key in figures]
        ys = [figures[key]["calls_per_s"] for key, _ in levels if key in figures]
        ax.plot(xs, ys, marker="o", label=client)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([1, 64, 256], ["1 (sequential)", "64", "256"])
    ax.set_xlabel("concurrent calls")
    ax.set_ylabel("calls per second")
    ax.set_title("throughput against one loopback server (medians of 3 runs)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
