"""The models/ training loop: a few steps of the LM train, and the demo's report is honest."""
import jax
import numpy as np

from models import train


def test_training_loop_loss_falls(tmp_path, capsys):
  result = train.main(["--steps", "40", "--eval-every", "20", "--batch", "8", "--seq", "32",
                       "--tile", "16", "--out", str(tmp_path)])
  report = capsys.readouterr().out
  # the demo says where its ops ran (off a GPU: float32, XLA's)
  if jax.default_backend() != "gpu":
    assert "dtype='float32'" in report and "expert ops run on: xla: top_k, rounded_slots, up_proj," in report
  first, last = result["history"][0][1], result["history"][-1][1]
  assert last < first - 0.3
  assert (tmp_path / "loss_curve.png").stat().st_size > 1000
  mem = result["memory"]
  assert mem["measured"] < mem["plain_autodiff"]
  assert np.isfinite(result["tokens_per_s"]) and result["tokens_per_s"] > 0


def test_training_without_rounding_bf16(tmp_path):
  result = train.main(["--steps", "10", "--batch", "4", "--seq", "16", "--rounding", "none",
                       "--dtype", "bfloat16", "--out", str(tmp_path)])
  assert np.isfinite(result["history"][-1][1])


def test_training_loop_trains_omnimoe(tmp_path):
  result = train.main(["--ffn", "omnimoe", "--omni-experts", "64", "--omni-k", "8", "--steps", "30",
                       "--eval-every", "15", "--batch", "8", "--seq", "32", "--out", str(tmp_path)])
  assert result["history"][-1][1] < result["history"][0][1] - 0.2


def test_token_rounding_study_runs(tmp_path):
  from benchmarks import token_rounding_study as study
  recs = study.main(["--seeds", "1", "--steps", "4", "--eval-every", "2", "--batch", "8", "--seq", "16",
                     "--tile", "16", "--variants", "TC top-K,TR nearest (NR-f)", "--out", str(tmp_path)])
  assert len(recs) == 2   # one seed of each variant
  text = (tmp_path / "results.md").read_text()
  assert "TR nearest (NR-f)" in text and (tmp_path / "eval_curves.png").exists()
  assert all(r["changed"] == 0 for r in recs if r["variant"] == "TC top-K")


def test_demo_dtype_auto_is_bfloat16_on_gpus_only():
  assert train.parse_args([]).dtype == "auto"
  assert train.compute_dtype("auto", "gpu") == "bfloat16"
  assert train.compute_dtype("auto", "cpu") == "float32"
  assert train.compute_dtype("float32", "gpu") == "float32"
