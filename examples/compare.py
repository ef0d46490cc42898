"""Compare train_lm.py summaries: print one table and draw both loss curves.

Usage: ``python examples/compare.py runs/demo/zoadam.json runs/demo/adam.json --png runs/demo/loss.png``
"""
from __future__ import annotations

import argparse
import json


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("summaries", nargs="+", help="summary JSON files written by train_lm.py --summary")
    ap.add_argument("--png", help="write the loss-curve figure here")
    ap.add_argument("--json", help="write the comparison (table rows and ratios) here")
    args = ap.parse_args(argv)
    runs = [json.load(open(p)) for p in args.summaries]
    base = next((r for r in runs if r["optimizer"] == "adam"), runs[-1])
    rows = []
    for r in runs:
        s = r["comm_stats"]
        rows.append({"optimizer": r["optimizer"], "world_size": r["world_size"], "steps": r["steps"],
                     "final_val_loss": r["final_val_loss"], "final_train_loss": r["final_train_loss"],
                     "bytes_sent_per_rank": s["bytes_sent_total"], "rounds": s["rounds_total"],
                     "steps_per_s": r["steps_per_s"],
                     "val_loss_vs_adam": r["final_val_loss"] / base["final_val_loss"] - 1,
                     "bytes_vs_adam": s["bytes_sent_total"] / max(1, base["comm_stats"]["bytes_sent_total"])})
    header = f"{'optimizer':<10}{'P':>3}{'steps':>7}{'val loss':>10}{'vs Adam':>9}{'MiB sent/rank':>15}" \
             f"{'vs Adam':>9}{'rounds':>8}{'steps/s':>9}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['optimizer']:<10}{row['world_size']:>3}{row['steps']:>7}{row['final_val_loss']:>10.4f}"
              f"{row['val_loss_vs_adam']:>+9.2%}{row['bytes_sent_per_rank'] / 2 ** 20:>15.1f}"
              f"{row['bytes_vs_adam']:>9.3f}{row['rounds']:>8}{row['steps_per_s']:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(16, 4))
        for r in runs:
            curve = r["train_curve"]
            k = 10
            smooth = [sum(curve[max(0, i - k + 1):i + 1]) / len(curve[max(0, i - k + 1):i + 1])
                      for i in range(len(curve))]
            ax1.plot(range(1, len(curve) + 1), smooth, label=f"{r['optimizer']} train (10-step mean)")
            ax1.plot(*zip(*r["val_curve"]), "o-", label=f"{r['optimizer']} validation")
            if "bytes_curve" in r:
                ax3.plot(range(1, len(r["bytes_curve"]) + 1), [b / 2 ** 20 for b in r["bytes_curve"]],
                         label=r["optimizer"])
            if "kinds" in r and r["optimizer"] == "zoadam":
                kinds = r["kinds"]
                for name, color in (("variance", "tab:red"), ("compressed", "tab:orange"),
                                    ("local", "tab:green"), ("sync", "tab:blue")):
                    xs = [i + 1 for i, k_ in enumerate(kinds) if k_ == name]
                    ax2.scatter(xs, [name] * len(xs), s=4, color=color)
        ax1.set_xlabel("step")
        ax1.set_ylabel("cross-entropy (nats/char)")
        ax1.set_title(f"char LM, P={runs[0]['world_size']}")
        ax1.legend()
        ax2.set_xlabel("step")
        ax2.set_title("0/1 Adam step kinds")
        ax3.set_xlabel("step")
        ax3.set_ylabel("MiB sent per rank (cumulative)")
        ax3.set_yscale("log")
        ax3.set_title("communication")
        ax3.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
