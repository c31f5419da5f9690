"""The plot of docs/fleet.md's study 2: TTFT p90 and TPOT p90 of each P/D split against the link,
beside co-located serving, from the `simkv run --out` folders of the study's commands.

    python benchmarks/fleet_figures.py results/pd docs/img/fleet_pd_links.png

`results/pd` holds `mixed4/` and `pd<P><D>-<link>/` (link: nvlink, ib-ndr, ethernet-100g, 10g),
each with the summary.json that `simkv run` writes.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LINKS = [("nvlink", "NVLink 4"), ("ib-ndr", "IB NDR"), ("ethernet-100g", "100 GbE"),
         ("10g", "10 Gb/s")]
SPLITS = [("13", "P/D 1:3"), ("22", "P/D 2:2"), ("31", "P/D 3:1")]


def _summary(folder: Path) -> dict:
    path = folder / "summary.json"
    if not path.is_file():
        sys.exit(f"error: {path}: missing (run the study's commands first)")
    return json.loads(path.read_text())


def main(argv: list) -> int:
    if len(argv) != 2:
        sys.exit("usage: python benchmarks/fleet_figures.py RESULTS_DIR OUT.png")
    results, out = Path(argv[0]), Path(argv[1])
    mixed = _summary(results / "mixed4")
    fig, (ttft, tpot) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(LINKS))
    for split, label in SPLITS:
        rows = [_summary(results / f"pd{split}-{link}") for link, _ in LINKS]
        ttft.plot(x, [r["ttft_s"]["p90"] for r in rows], marker="o", label=label)
        tpot.plot(x, [1e3 * r["tpot_s"]["p90"] for r in rows], marker="o", label=label)
    ttft.axhline(mixed["ttft_s"]["p90"], color="black", ls="--", label="4 mixed")
    tpot.axhline(1e3 * mixed["tpot_s"]["p90"], color="black", ls="--", label="4 mixed")
    for ax, title, unit in ((ttft, "TTFT p90", "s"), (tpot, "TPOT p90", "ms")):
        ax.set_xticks(list(x), [name for _, name in LINKS])
        ax.set_xlabel("KV transfer link")
        ax.set_ylabel(f"{title} ({unit})")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    ttft.set_title("TTFT p90 (SLO 2 s)")
    tpot.set_title("TPOT p90 (SLO 100 ms)")
    tpot.legend(loc="lower right", fontsize=8)
    fig.suptitle("Azure conv, first 3,000 requests at 4x, 4 H200s: P/D splits against co-located",
                 fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
