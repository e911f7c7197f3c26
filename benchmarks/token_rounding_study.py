"""Does tile-aligned token rounding (TR) train as well as plain top-K (TC) at small scale?

  python -m benchmarks.token_rounding_study            # CPU default: ~20 minutes
  python -m benchmarks.token_rounding_study --steps 2000 --d-model 256 --batch 64   # GPU

Trains the models/ LM from the same initialisation on the same data stream with TC, TR in every
rounding mode, and TR/TC with the microbatch shrunk so each expert expects one tile of tokens;
3 seeds each. Evaluation always routes with plain top-K. Writes a markdown table, JSON and a
PNG of the held-out loss curves.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from models import train

# name: (rounding, batch multiplier): the small-microbatch runs use batch / 4, which with the
# defaults (32 x 64 tokens, E=8, K=2, tile 128) gives 512 tokens x 2 / 8 = 128 = one tile
VARIANTS = {
    "TC top-K": ("none", 1),
    "TR nearest (NR-f)": ("nearest", 1),
    "TR stochastic (SR-f)": ("stochastic", 1),
    "TR up": ("up", 1),
    "TR down": ("down", 1),
    "TR balanced": ("balanced", 1),
    "TC at 1 tile/expert": ("none", 4),
    "TR nearest at 1 tile/expert": ("nearest", 4),
}


def run(variant, seed, a):
  rounding, shrink = VARIANTS[variant]
  argv = ["--steps", str(a.steps), "--batch", str(a.batch // shrink), "--seq", str(a.seq),
          "--d-model", str(a.d_model), "--experts", str(a.experts), "--k", str(a.k),
          "--tile", str(a.tile), "--rounding", rounding, "--seed", str(seed),
          "--eval-every", str(a.eval_every), "--quiet", "--out", os.path.join(a.out, "runs")]
  r = train.main(argv)
  last = r["routing"][len(r["routing"]) // 2:]  # second half of training
  return dict(variant=variant, seed=seed, final_train=float(np.mean([h[1] for h in r["history"][-5:]])),
              final_eval=r["evals"][-1][1], evals=r["evals"],
              changed=float(np.mean([x["changed"] for x in last])),
              imbalance=float(np.mean([x["imbalance"] for x in last])),
              tc_padding=float(np.mean([x["tc_padding"] for x in last])),
              tokens_per_expert_tiles=a.batch // shrink * a.seq * a.k / a.experts / a.tile,
              floor=r["floor"])


def summarize(records, floor):
  rows = ["| variant | expected tokens per expert (tiles) | final train loss | held-out loss (TC routing) | "
          "held-out minus TC, same seed | load imbalance (max/mean) | decisions changed by rounding | "
          "TC padding at tile |",
          "|---|---|---|---|---|---|---|---|"]
  for v in VARIANTS:
    rs = [r for r in records if r["variant"] == v]
    if not rs:
      continue
    def ms(key, fmt="{:.4f}"):
      vals = np.array([r[key] for r in rs])
      return f"{fmt.format(vals.mean())} ± {fmt.format(vals.std(ddof=1) if len(vals) > 1 else 0.0)}"
    baseline = "TC at 1 tile/expert" if "1 tile" in v else "TC top-K"
    base = {r["seed"]: r["final_eval"] for r in records if r["variant"] == baseline}
    diffs = np.array([r["final_eval"] - base[r["seed"]] for r in rs if r["seed"] in base])
    paired = (f"{diffs.mean():+.4f} ± {diffs.std(ddof=1) if len(diffs) > 1 else 0.0:.4f}"
              if len(diffs) else "-")
    rows.append(f"| {v} | {rs[0]['tokens_per_expert_tiles']:.0f} | {ms('final_train')} | {ms('final_eval')} | "
                f"{paired} | {ms('imbalance', '{:.3f}')} | {ms('changed', '{:.3%}')} | "
                f"{ms('tc_padding', '{:.1%}')} |")
  rows.append(f"\nMean ± standard deviation over {len({r['seed'] for r in records})} seeds. "
              f"Entropy floor of the data (mean over seeds; each seed draws its own Markov language): "
              f"{floor:.3f} nats/token.")
  return "\n".join(rows)


def plot(records, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for i, v in enumerate(VARIANTS):
    rs = [r for r in records if r["variant"] == v]
    if not rs:
      continue
    steps = [s for s, _ in rs[0]["evals"]]
    curves = np.array([[e for _, e in r["evals"]] for r in rs])
    ax.plot(steps, curves.mean(0), label=v, color=f"C{i}", ls="--" if "1 tile" in v else "-")
  ax.set_xlabel("step")
  ax.set_ylabel("held-out loss, plain top-K routing (nats)")
  ax.set_yscale("log")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seeds", type=int, default=3)
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--seq", type=int, default=64)
  p.add_argument("--d-model", type=int, default=64)
  p.add_argument("--experts", type=int, default=8)
  p.add_argument("--k", type=int, default=2)
  p.add_argument("--tile", type=int, default=128)
  p.add_argument("--eval-every", type=int, default=50)
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--out", default="runs/token_rounding_study", help="folder for results.md, results.json and eval_curves.png")
  p.add_argument("--report-only", action="store_true", help="rewrite the report from results.json")
  a = p.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  records = []
  if a.report_only:
    with open(os.path.join(a.out, "results.json")) as f:
      records = json.load(f)
  for seed in range(0 if a.report_only else a.seeds):
    for v in a.variants.split(","):
      rec = run(v, seed, a)
      records.append(rec)
      print(f"seed {seed} {v:28s} train {rec['final_train']:.4f} eval {rec['final_eval']:.4f} "
            f"changed {rec['changed']:.2%} TC padding {rec['tc_padding']:.1%}", flush=True)
  floor = float(np.mean([r["floor"] for r in records]))
  table = summarize(records, floor)
  with open(os.path.join(a.out, "results.md"), "w") as f:
    f.write(f"# Token rounding study\n\nCommand: python -m benchmarks.token_rounding_study "
            f"{' '.join(argv or [])}\n\nSettings: {vars(a)}\n\n{table}\n")
  with open(os.path.join(a.out, "results.json"), "w") as f:
    json.dump(records, f, indent=1)
  plot(records, os.path.join(a.out, "eval_curves.png"))
  print(table)
  return records


if __name__ == "__main__":
  main()
