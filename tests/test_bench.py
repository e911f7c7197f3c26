"""The benchmark harness runs end to end at a tiny size on CPU and writes its records."""
import json

from benchmarks import bench

KEYS = {"impl", "config", "T", "d", "n", "E", "K", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_tflops",
        "fwd_bwd_tflops", "act_bytes", "status", "gpu", "date", "versions"}


def test_bench_tiny(tmp_path):
  out = tmp_path / "tiny"
  records = bench.main(["--tiny", "--impls", "xla,lax_ragged_dot,dense,nosuch", "--iters", "1",
                        "--reps", "1", "--out", str(out)])
  saved = json.loads((tmp_path / "tiny.json").read_text())
  assert saved == json.loads(json.dumps(records))
  by_impl = {r["impl"]: r for r in saved}
  for r in saved:
    assert KEYS <= set(r)
  assert by_impl["xla"]["status"] == "ok" and by_impl["xla"]["fwd_ms"] > 0
  assert by_impl["nosuch"]["status"].startswith("ValueError")  # a failure is a row
  # our layer keeps less for backward than plain autodiff of the same math
  assert by_impl["xla"]["act_bytes"] < by_impl["lax_ragged_dot"]["act_bytes"]
