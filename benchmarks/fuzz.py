"""Route fuzzing of a live reference server (``asyncsync/testing/fuzz.py`` has the campaign and its checks).

    python -m benchmarks.fuzz [--requests 20000] [--seed 0]     -> results/fuzz.json, fuzz.png

``tests/faults/test_route_fuzz.py`` runs the same campaign in the default suite with fewer requests
(``--fuzz-requests`` for more); docs/faults.md "What the fuzz run saw" has this run's figures.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

import torch

from asyncsync.testing import fuzz


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = {"2xx": lambda s: 200 <= s < 300, "4xx": lambda s: 400 <= s < 500, "503 (documented)": lambda s: s == 503,
               "other 5xx": lambda s: s >= 500 and s != 503, "no answer (a body the client cut short)": lambda s: s == 0}
    kinds = list(results["status_by_kind"])
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(kinds) + 1.5))
    left = [0] * len(kinds)
    for name, test in classes.items():
        counts = [sum(n for s, n in results["status_by_kind"][k].items() if test(int(s))) for k in kinds]
        ax.barh(kinds, counts, left=left, label=name)
        left = [a + b for a, b in zip(left, counts)]
    ax.set_xlabel("requests")
    ax.set_title(f"{results['requests']} bad requests to a reference server: answers by kind")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    from benchmarks.common import save

    parser = argparse.ArgumentParser(description=f"{__doc__}\n{fuzz.__doc__}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=fuzz.CONCURRENCY)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    results = fuzz.campaign(args.requests, args.seed, args.concurrency)
    save("fuzz", results, plot)
    print(json.dumps({k: results[k] for k in ("requests", "status", "server_errors", "no_answer", "crashed",
                                              "resources", "valid_version_after", "wall_s", "problems")}, indent=2))


if __name__ == "__main__":
    main()
