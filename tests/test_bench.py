"""The benchmark harness runs end to end at a tiny size on CPU and writes its records."""
import json

import pytest

from benchmarks import bench

KEYS = {"impl", "config", "T", "d", "n", "E", "K", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_tflops",
        "fwd_bwd_tflops", "act_bytes", "step_bytes", "status", "gpu", "date", "versions", "commit",
        "command", "round", "grads", "iters", "reps"}


def test_bench_tiny(tmp_path, capsys):
  out = tmp_path / "tiny"
  records = bench.main(["--tiny", "--impls", "xla,xla/w2,xla/w1-2,lax_ragged_dot,dense,nosuch",
                        "--iters", "1", "--reps", "1", "--out", str(out), "--commit", "abc"])
  saved = json.loads((out / "bench.json").read_text())
  assert saved == json.loads(json.dumps(records))
  assert (out / "bench.png").exists()
  assert f"wrote {out / 'bench.json'}" in capsys.readouterr().out
  by_impl = {r["impl"]: r for r in saved}
  for r in saved:
    assert KEYS <= set(r), KEYS - set(r)
    assert r["commit"] == "abc" and r["round"] == 0 and r["iters"] == 1
  assert by_impl["xla"]["status"] == "ok" and by_impl["xla"]["fwd_ms"] > 0
  assert by_impl["xla/w2"]["status"] == "ok"   # the layer with two column windows
  assert by_impl["xla/w1-2"]["status"] == "ok"   # two in the backward only
  assert by_impl["nosuch"]["status"].startswith("ValueError")  # a failure is a row
  # our layer keeps less for backward than plain autodiff of the same math
  assert by_impl["xla"]["act_bytes"] < by_impl["lax_ragged_dot"]["act_bytes"]
  # a step needs at least its gradients: x, router, w1, w2 in float32 here
  T, d, n, E = (by_impl["xla"][k] for k in "TdnE")
  assert by_impl["xla"]["step_bytes"] >= 4 * (T * d + d * E + E * d * 2 * n + E * n * d)


FAKE_TORCH = """
import json, sys
for line in sys.stdin:
  if not line.strip():
    break
  req = json.loads(line)
  if req["config"] == "slow":
    import time; time.sleep(60)
  print("a line that is not a record", flush=True)
  T = req["shape"][0]
  print(json.dumps(dict(impl="torch_sonicmoe", config=req["config"], status="ok",
                        fwd_ms=T / 256, fwd_bwd_ms=3 * T / 256, kernel_fwd_ms=0.5,
                        kernel_fwd_bwd_ms=1.5, iters=req["iters"], versions={"torch": "9.9"},
                        pid=__import__("os").getpid())), flush=True)
"""


def test_torch_worker_answers_each_config_in_one_process(tmp_path):
  """The PyTorch process stays up across requests (one pid), gets the iterations asked for,
  keeps its own versions, skips lines that are not records, and a config it does not answer
  in time is a row saying so, after which a new process serves the next one."""
  import sys
  script = tmp_path / "fake_torch.py"
  script.write_text(FAKE_TORCH)
  worker = bench.TorchWorker(timeout_s=3, command=[sys.executable, str(script)])
  meta = dict(gpu="test", versions={"jax": "0.0"}, commit="abc")
  try:
    a = worker.measure("a", (256, 128, 64, 4, 2), 7, 2, meta)
    b = worker.measure("b", (512, 128, 64, 4, 2), 7, 2, meta)
    slow = worker.measure("slow", (256, 128, 64, 4, 2), 7, 2, meta)
    c = worker.measure("c", (256, 128, 64, 4, 2), 7, 2, meta)
  finally:
    worker.close()
  assert a["status"] == b["status"] == "ok" and a["pid"] == b["pid"]
  assert a["iters"] == 7 and a["versions"] == {"torch": "9.9"} and a["gpu"] == "test"
  assert b["fwd_ms"] == 2.0 and b["fwd_tflops"] > 0 and b["T"] == 512
  assert slow["status"].startswith("timeout") and slow["fwd_ms"] is None
  assert slow["versions"] == {"jax": "0.0"}
  assert c["status"] == "ok" and c["pid"] != a["pid"]


def test_kernel_configs_from_the_command_line():
  """bench's --cute and --pallas FIELD=VALUE texts become the configs (ints, bools, tuples by
  the field), and the records name only the fields changed; an unknown field is an error
  naming the fields."""
  from ffi.config import CuteConfig
  from pallas_kernels.config import PallasConfig
  configs = bench.kernel_config_from(["dw1_gather_in_kernel=true"],
                                     ["store_cluster_n=2", "tma_gather=dw1", "wgrad_dynamic_order=dw2"])
  assert configs["pallas"] == PallasConfig(dw1_gather_in_kernel=True)
  assert configs["cute"] == CuteConfig(store_cluster_n=2, tma_gather=("dw1",),
                                       wgrad_dynamic_order=("dw2",))
  assert bench.changed_fields(configs) == {
      "pallas": {"dw1_gather_in_kernel": True},
      "cute": {"store_cluster_n": 2, "tma_gather": ("dw1",), "wgrad_dynamic_order": ("dw2",)}}
  assert bench.kernel_config_from([], []) is None
  with pytest.raises(ValueError, match="store_cluster_n"):
    bench.kernel_config_from([], ["cluster=2"])
  with pytest.raises(ValueError, match="store_cluster_n must be one of"):
    bench.kernel_config_from([], ["store_cluster_n=3"])


def test_cute_variants_are_measured_beside_the_impls_that_run_the_cute_backend(tmp_path):
  """--cute-variant adds, for auto and cute only, one more measured entry a variant: its
  fields on top of --cute's, its records' impl 'auto [FIELDS]', in every round, order
  reversed in odd rounds."""
  from ffi.config import CuteConfig
  entries = bench.measured_entries(["auto", "xla"], [], ["store_cluster_n=2"],
                                   ["store_wide_cluster_m=2+store_wide_cluster_n=1"])
  assert [(impl, label) for impl, label, _ in entries] == [
      ("auto", "auto"), ("xla", "xla"),
      ("auto", "auto [store_wide_cluster_m=2+store_wide_cluster_n=1]")]
  assert entries[2][2]["cute"] == CuteConfig(store_cluster_n=2, store_wide_cluster_m=2,
                                             store_wide_cluster_n=1)
  records = bench.main(["--tiny", "--impls", "auto", "--cute-variant", "store_stages=2",
                        "--iters", "1", "--reps", "1", "--rounds", "2", "--out",
                        str(tmp_path), "--commit", "abc"])
  assert [r["impl"] for r in records] == ["auto", "auto [store_stages=2]",
                                          "auto [store_stages=2]", "auto"]
  assert [r["kernel_config"] for r in records[:2]] == [{}, {"cute": {"store_stages": 2}}]
  assert all(r["status"] == "ok" for r in records)


def test_table_gives_medians_over_rounds_and_ratios_to_the_pytorch_rows():
  rows = [dict(config="c", impl=impl, status="ok", round=r, fwd_ms=f, fwd_bwd_ms=3 * f,
               kernel_fwd_ms=f, kernel_fwd_bwd_ms=2 * f, fwd_bwd_tflops=1.0, act_bytes=2**20,
               step_bytes=2**21)
          for r, (ours, theirs) in enumerate([(1.0, 2.0), (1.2, 2.0), (5.0, 2.0)])
          for impl, f in (("auto", ours), ("torch_sonicmoe", theirs))]
  med = bench.medians(rows)
  assert med[("c", "auto")][0] == 3 and med[("c", "auto")][1]["fwd_ms"] == 1.2
  text = bench.table(rows)
  assert "/ torch_sonicmoe" in text
  ratio_line = text.splitlines()[2]
  assert ratio_line.split()[2] == "0.600"   # kernels fwd: 1.2 / 2.0


def test_tile_sweep_custom_shape(tmp_path):
  """The tile sweep on a small shape (interpret mode off the GPU): a tile that fits is timed and
  records the depth its chained pipeline ran; one that does not fit is a row with its error;
  --interleave times the rows that run in rounds."""
  from benchmarks import tile_sweep
  recs = {}
  for kernels, block_n in [("down_proj", "128"), ("dh", "256")]:   # the rows checked below
    out = tmp_path / f"sweep_{block_n}"
    tile_sweep.main(["--configs", "", "--custom", "256,128,256,4,2", "--kernels", kernels,
                     "--block-n", block_n, "--stages", "3", "--iters", "1", "--interleave", "2",
                     "--out", str(out)])
    recs.update({(r["kernel"], r["block_n"]): r
                 for r in json.loads((out / "tile_sweep.json").read_text())})
  down = recs[("down_proj", 128)]
  assert down["ms"] > 0 and down["chained_stages"] == 2  # K = n = 256: 4 steps, 3 does not divide
  dh_wide = recs[("dh", 256)]  # 2 stages x 48 KB + 2 warpgroups x 96.5 KB of epilogue buffers
  assert dh_wide["ms"] is None and "shared memory" in dh_wide["error"]


def test_check_anchors_tiny(monkeypatch):
  """The anchor correctness check on a tiny config with the xla backend: it passes, and it
  fails when the per-token reference disagrees (here: scaled by 1.1)."""
  from benchmarks import check_anchors
  cfg = (512, 128, 64, 8, 2)
  rec = check_anchors.check("tiny", cfg, "xla", None)
  assert rec["ok"] and rec["out_rel_err_max"] < 1e-2 and rec["dw_rel_err_max"] < 1e-2
  rounded = check_anchors.check("tiny", cfg, "xla", "nearest")
  assert rounded["ok"] and rounded["dx_rel_err_max"] is None
  assert check_anchors.check("tiny", cfg, "up_proj=xla+dh=xla", None)["ok"]   # a per-op mix
  # column windows
  assert check_anchors.check("tiny", (512, 384, 64, 8, 2), "xla", None, windows=3)["ok"]
  real = check_anchors.token_output
  monkeypatch.setattr(check_anchors, "token_output", lambda *a: 1.1 * real(*a))
  check_anchors.token_references.clear_cache()
  assert not check_anchors.check("tiny", cfg, "xla", None)["ok"]


def test_kernels_breakdown_of_a_per_op_mix(tmp_path):
  """benchmarks.kernels takes a per-op mix like bench.py's impls: every op is timed once."""
  from benchmarks import kernels
  out = tmp_path
  kernels.main(["--backend", "dh=xla+dx_tilde=xla", "--custom", "64,32,16,4,2", "--iters", "1",
                "--reps", "1", "--out", str(out)])
  ops = {r["op"].strip(): r for r in json.loads((out / "kernels.json").read_text())}
  for op in ("routing plan", "up_proj (+ gather X)", "down_proj", "dh (+ gather dO)", "dx_tilde",
             "dw1 (+ gather X)", "dw2 (+ gather dO)"):
    assert ops[op]["ms"] > 0
  assert "up_proj (gather in kernel)" not in ops   # Pallas-only rows need backend "pallas"


def test_device_kernel_times_count_gpu_stream_events_only():
  """Our per-kernel times (device_kernels.per_kernel) sum the GPU planes' stream lines per
  kernel name and step: host planes and the planes' summary lines are not counted twice."""
  from types import SimpleNamespace as NS
  from benchmarks import device_kernels
  event = lambda name, ns: NS(name=name, duration_ns=ns)
  planes = [
      NS(name="/host:CPU", lines=[NS(name="python3", events=[event("gemm", 5e6)])]),
      NS(name="/device:GPU:0", lines=[
          NS(name="Stream #14(compute)", events=[event("gemm", 2e6), event("gather", 1e6),
                                                 event("gemm", 2e6)]),
          NS(name="Stream #15(copy)", events=[event("gather", 1e6)]),
          NS(name="XLA Ops", events=[event("fusion.1", 6e6)])]),
  ]
  total, ranked = device_kernels.per_kernel(planes, steps=2)
  assert ranked == [("gemm", 2.0), ("gather", 1.0)] and total == 3.0
  # one step's launches: the first half of two steps' events, in start order, each timed
  timed = lambda name, start, ms: NS(name=name, start_ns=start, duration_ns=ms * 1e6)
  launches = [NS(name="/device:GPU:0", lines=[
      NS(name="Stream #14(compute)", events=[timed("up", 0, 2), timed("down", 20, 3),
                                             timed("up", 40, 2), timed("down", 60, 3)]),
      NS(name="Stream #15(copy)", events=[timed("gather", 10, 1), timed("gather", 50, 1)])])]
  assert device_kernels.step_launches(launches, steps=2) == [
      ("up", 2.0), ("gather", 1.0), ("down", 3.0)]
  assert device_kernels.per_kernel(planes[:1], steps=2) is None


def test_device_planes_copy_one_pass_iterators_so_both_readers_see_every_event():
  """ProfileData's planes, lines and events can be read once (a second reader would see
  no launches); device_planes keeps the GPU stream lines."""
  from types import SimpleNamespace as NS
  from benchmarks import device_kernels
  timed = lambda name, start, ms: NS(name=name, start_ns=start, duration_ns=ms * 1e6)
  one_pass = lambda plane_list: iter(plane_list)
  planes = one_pass([
      NS(name="/host:CPU", lines=iter([NS(name="Stream #1", events=iter([timed("x", 0, 9)]))])),
      NS(name="/device:GPU:0", lines=iter([
          NS(name="Stream #14(compute)", events=iter([timed("up", 0, 2), timed("up", 40, 2)])),
          NS(name="XLA Ops", events=iter([timed("fusion", 0, 4)]))]))])
  copied = device_kernels.device_planes(planes)
  assert device_kernels.per_kernel(copied, steps=2) == (2.0, [("up", 2.0)])
  assert device_kernels.step_launches(copied, steps=2) == [("up", 2.0)]


def test_idle_gaps_count_overlaps_once_and_name_the_kernels_around_each_gap():
  """device_kernels.idle_gaps: the span of a step's stream events, the time some kernel ran
  (overlapping kernels on two streams counted once), and the idle gaps longest first."""
  from types import SimpleNamespace as NS
  from benchmarks import device_kernels
  ev = lambda name, start, end: NS(name=name, start_ns=start * 1e6, duration_ns=(end - start) * 1e6)
  planes = [NS(name="/device:GPU:0", lines=[
      NS(name="Stream #14(compute)", events=[ev("a", 0, 10), ev("c", 30, 40), ev("e", 100, 110)]),
      NS(name="Stream #15(copy)", events=[ev("b", 5, 20), ev("d", 40, 50)]),
      NS(name="XLA Ops", events=[ev("fusion", 0, 200)])])]
  events = device_kernels.stream_events(planes)
  assert [e[2] for e in events] == ["a", "b", "c", "d", "e"]
  span, busy, gaps = device_kernels.idle_gaps(events)
  assert (span, busy) == (110.0, 50.0)
  assert gaps == [(50.0, "d", "e"), (10.0, "b", "c")]
  assert device_kernels.idle_gaps([]) == (0.0, 0.0, [])


def test_device_kernel_times_off_the_gpu_are_none():
  import jax
  import jax.numpy as jnp
  from benchmarks import device_kernels
  assert device_kernels.kernel_times(jax.jit(jnp.tanh), (jnp.ones(8),), steps=1) is None


def test_kernel_table_sums_kernels_per_op(tmp_path):
  """--by-op: our CuTe kernels by their labels, the quack GEMMs by their epilogues, and an XLA
  fusion right after one of our store GEMMs as its aggregation (elsewhere: other)."""
  from benchmarks import kernel_table
  ours = dict(config="7B", impl="auto", kernels_fwd_bwd=[["x", 0]], kernel_launches_fwd_bwd=[
      ["loop_reduce_fusion_2", 0.01], ["sonicmoe_up_proj_gather_kernel__k", 1.0],
      ["sonicmoe_pingpong_matmul_kernel__k", 0.5], ["loop_reduce_fusion", 0.2],
      ["sonicmoe_dh_gather_kernel__k", 0.7], ["sonicmoe_persistent_weight_grad_gather_kernel__k", 0.9],
      ["input_reduce_fusion", 0.05]])
  theirs = dict(config="7B", impl="torch_sonicmoe", kernels_fwd_bwd=[["x", 0]], kernel_launches_fwd_bwd=[
      ["kernel_cutlass_kernel_quackgemm_actGemmGatedSm90_object_at__x", 0.8],
      ["kernel_cutlass_kernel_quackgemm_dactGemmDGatedSm90_object_at__x", 0.6],
      ["kernel_cutlass_kernel_quackgemm_default_epiGemmDefaultSm90_object_at__x", 0.4],
      ["token_gather_sum_kernel", 0.3], ["void at::native::vectorized_elementwise_kernel", 0.1],
      ["nvjet_sm90_tst_64x256", 0.02]])
  assert kernel_table.by_op(ours) == {"up-projection": 1.0, "dH": 0.7, "other GEMMs": 1.4,
                                      "aggregations": 0.2, "other": 0.01 + 0.05}
  assert kernel_table.by_op(theirs) == pytest.approx(
      {"up-projection": 0.8, "dH": 0.6, "other GEMMs": 0.4, "aggregations": 0.4, "other": 0.02})
  path = tmp_path / "bench.json"
  path.write_text(json.dumps([ours, theirs]))
  lines = kernel_table.main([str(path), "--by-op"]).splitlines()
  assert lines[1].split()[:2] == ["7B", "auto"] and lines[1].split()[-1] == "3.360"


def test_kernel_table_names_the_six_gemms(tmp_path):
  """--by-gemm: ours by label (store GEMMs before dH: down-projection windows summed, after it:
  dX~; the longer weight gradient is dW1), theirs by epilogue and launch order (dW2, dX~, dW1
  after dH); medians over rounds, and each impl against the first."""
  from benchmarks import kernel_table
  quack = "kernel_cutlass_kernel_quackgemm_{}Sm90_object_at__x"
  def ours(scale):
    return dict(config="7B", impl="auto", kernels_fwd_bwd=[["x", 0]], kernel_launches_fwd_bwd=[
        ["sonicmoe_up_proj_gather_kernel__k", 1.0 * scale], ["sonicmoe_pingpong_matmul_kernel__k", 0.25],
        ["loop_reduce_fusion", 0.2], ["sonicmoe_pingpong_matmul_kernel__k", 0.25],
        ["sonicmoe_dh_gather_kernel__k", 0.7], ["sonicmoe_persistent_weight_grad_gather_kernel__k", 0.3],
        ["sonicmoe_persistent_matmul_kernel__k", 0.8],
        ["sonicmoe_persistent_weight_grad_gather_kernel__k", 0.9]])
  theirs = dict(config="7B", impl="torch_sonicmoe", kernels_fwd_bwd=[["x", 0]], kernel_launches_fwd_bwd=[
      [quack.format("actGemmGated"), 1.2], [quack.format("default_epiGemmDefault"), 0.4],
      ["token_gather_sum_kernel", 0.3], [quack.format("dactGemmDGated"), 0.6],
      [quack.format("default_epiGemmDefault"), 0.35], [quack.format("default_epiGemmDefault"), 0.85],
      [quack.format("default_epiGemmDefault"), 0.95]])
  assert kernel_table.by_gemm(ours(1.0)) == pytest.approx(
      {"up-proj": 1.0, "down-proj": 0.5, "dH": 0.7, "dX~": 0.8, "dW1": 0.9, "dW2": 0.3})
  assert kernel_table.by_gemm(theirs) == pytest.approx(
      {"up-proj": 1.2, "down-proj": 0.4, "dH": 0.6, "dX~": 0.85, "dW1": 0.95, "dW2": 0.35})
  rounds = [tmp_path / f"round{i}.json" for i in range(3)]
  for path, scale in zip(rounds, (1.0, 1.2, 0.9)):
    path.write_text(json.dumps([ours(scale), theirs]))
  lines = kernel_table.main([*map(str, rounds), "--by-gemm"]).splitlines()
  assert lines[1].split()[:4] == ["7B", "auto", "3", "1.000"]   # the median of 1.0, 1.2, 0.9
  assert lines[2].split()[:3] == ["7B", "torch_sonicmoe", "3"]
  assert lines[3].split()[-6:] == ["1.200", "0.800", "0.857", "1.062", "1.056", "1.167"]


def test_kernel_table_roofline_gives_each_gemms_share_of_the_cards_peaks(tmp_path):
  """--roofline: a GEMM's FLOPs and least bytes from the layer's shape, the TF/s and GB/s of its
  median time, and their shares of the card's bf16 peak and HBM bandwidth."""
  from benchmarks import kernel_table
  T, d, n, E, K = 1024, 512, 128, 8, 2
  flops, nbytes = kernel_table.gemm_work("down-proj", T, d, n, E, K)
  assert flops == 2 * T * K * n * d
  assert nbytes == 2 * (T * K * n + E * n * d + T * K * d)   # A, W2 read; Y written (bf16)
  assert kernel_table.gemm_work("dX~", T, d, n, E, K)[0] == 2 * flops
  record = dict(config="c", impl="auto", gpu="NVIDIA H100 80GB HBM3", T=T, d=d, n=n, E=E, K=K,
                kernels_fwd_bwd=[["x", 0]], kernel_launches_fwd_bwd=[
                    ["sonicmoe_up_proj_gather_kernel__k", 0.01],
                    ["sonicmoe_pingpong_matmul_kernel__k", 0.002]])
  path = tmp_path / "bench.json"
  path.write_text(json.dumps([record]))
  lines = kernel_table.main([str(path), "--roofline"]).splitlines()
  down = next(line.split() for line in lines if "down-proj" in line)
  tflops = flops / 0.002 / 1e9
  assert float(down[-4]) == pytest.approx(tflops, rel=1e-3)
  assert float(down[-3]) == pytest.approx(100 * tflops / 989.0, abs=0.1)
  assert float(down[-1]) == pytest.approx(100 * nbytes / 0.002 / 1e9 / 3.35, abs=0.1)


def test_kernel_table_by_layer_takes_medians_over_rounds(tmp_path):
  """--by-layer: per config and impl the medians over rounds of the step's kernels, wall times
  and memory (MiB), and the TF/s of the median wall forward+backward from the anchor's FLOP;
  a record that did not run is left out."""
  from benchmarks import configs, kernel_table
  def record(impl, wall, status="ok"):
    return dict(config="7B-n256", impl=impl, status=status, kernel_fwd_ms=1.0,
                kernel_fwd_bwd_ms=wall - 0.5, fwd_ms=1.5, fwd_bwd_ms=wall,
                act_bytes=200 * 2 ** 20, step_bytes=wall * 2 ** 30)
  rounds = [tmp_path / f"round{i}.json" for i in range(3)]
  for path, wall in zip(rounds, (3.0, 4.0, 2.0)):
    path.write_text(json.dumps([record("auto", wall), record("torch_sonicmoe", 2 * wall),
                                record("pallas", 1.0, status="error")]))
  lines = kernel_table.main([*map(str, rounds), "--by-layer"]).splitlines()
  assert len(lines) == 3   # the header, auto, torch_sonicmoe (pallas never ran)
  ours, theirs = lines[1].split(), lines[2].split()
  tflops = configs.fwd_bwd_flops(*configs.ANCHORS["7B-n256"]) / 3.0 / 1e9
  assert ours == ["7B-n256", "auto", "3", "1.000", "2.500", "1.500", "3.000", "200.000",
                  "3072.000", f"{tflops:.0f}"]
  assert theirs[:3] == ["7B-n256", "torch_sonicmoe", "3"] and theirs[6] == "6.000"


def test_kernel_table_keeps_runs_under_other_settings_apart(tmp_path):
  """--by-gemm and --by-layer: one impl's runs under another kernel configuration (bench.py's
  kernel_config: the fields it changed) are other rows, named by those fields, with their own
  medians."""
  from benchmarks import kernel_table
  def record(min_k, dx_ms):
    return dict(config="7B-n256", impl="auto", status="ok",
                kernel_config={"cute": {"store_wide_min_k": min_k}} if min_k else {},
                kernel_fwd_ms=1.0, kernel_fwd_bwd_ms=3.0, fwd_ms=1.5, fwd_bwd_ms=dx_ms + 3,
                act_bytes=0, step_bytes=0, kernels_fwd_bwd=[["x", 0]], kernel_launches_fwd_bwd=[
                    ["sonicmoe_dh_gather_kernel__k", 0.7], ["sonicmoe_pingpong_matmul_kernel__k", dx_ms]])
  rounds = [tmp_path / f"round{i}.json" for i in range(2)]
  for path, ms in zip(rounds, (1.0, 3.0)):
    path.write_text(json.dumps([record(None, ms), record(4096, ms / 2)]))
  gemms = kernel_table.main([*map(str, rounds), "--by-gemm"]).splitlines()
  assert [line.split()[1] for line in gemms[1:3]] == ["auto", "auto[cute.store_wide_min_k=4096]"]
  assert gemms[1].split()[2:] == ["2", "-", "-", "0.700", "2.000", "-", "-"]
  assert gemms[2].split()[6] == "1.000" and gemms[3].split()[-3] == "0.500"
  layer = kernel_table.main([*map(str, rounds), "--by-layer"]).splitlines()
  assert [line.split()[6] for line in layer[1:]] == ["5.000", "4.000"]   # wall f+b medians
  # a --cute-variant record ('auto [FIELDS]') is named by its impl and changed fields alike
  labelled = dict(record(4096, 1.0), impl="auto [store_wide_min_k=4096]")
  assert kernel_table.variant(labelled) == "auto[cute.store_wide_min_k=4096]"


def test_kernel_table_puts_impls_side_by_side(tmp_path):
  """benchmarks.kernel_table lists each impl's kernels per config in columns, longest first,
  skipping rows without profiles, and reads them back from a bench.json."""
  from benchmarks import kernel_table
  records = [
      dict(config="7B", impl="auto", kernel_fwd_bwd_ms=3.0,
           kernels_fwd_bwd=[["up_proj_kernel", 2.0], ["fusion.3", 1.0]]),
      dict(config="7B", impl="torch_sonicmoe", kernel_fwd_bwd_ms=2.5,
           kernels_fwd_bwd=[["GemmGated", 1.5], ["gather_sum", 0.6], ["add", 0.4]],
           kernel_launches_fwd_bwd=[["add", 0.4], ["GemmGated", 0.7], ["gather_sum", 0.6],
                                    ["GemmGated", 0.8]]),
      dict(config="7B", impl="dense", status="ok"),
  ]
  path = tmp_path / "bench.json"
  path.write_text(json.dumps(records))
  lines = kernel_table.main([str(path), "--top", "5"]).splitlines()
  assert lines[0] == "7B: auto 3.000 ms   torch_sonicmoe 2.500 ms"
  assert len(lines) == 4 and "up_proj_kernel" in lines[1] and "GemmGated" in lines[1]
  assert "fusion.3" in lines[2] and "  1.000" in lines[2] and lines[3].split("|")[1].strip().startswith("add")
  # --order: every launch in launch order where the record has them (torch's), longest first
  # where not; --min-ms leaves out the short ones
  ordered = kernel_table.main([str(path), "--order"]).splitlines()
  assert [line.split("|")[1].split()[0] for line in ordered[1:]] == [
      "add", "GemmGated", "gather_sum", "GemmGated"]
  assert ordered[4].split("|")[1].split()[1] == "0.800"
  assert ordered[1].split("|")[0].strip().startswith("up_proj_kernel")
  ordered = kernel_table.main([str(path), "--order", "--min-ms", "0.5"]).splitlines()
  assert [line.split("|")[1].split()[0] for line in ordered[1:]] == [
      "GemmGated", "gather_sum", "GemmGated"]
  assert kernel_table.short_name(
      "kernel_cutlass_kernel_quackgemm_actGemmGatedSm90_object_at__TiledMMA_ThrLayoutVMNK1282111"
      "12800_PermutationMNK____MMAAtom_ThrID1281_ShapeMNK6425616_TVLayoutA") == \
      "quackgemm_actGemmGatedSm90 [MNK 64,256,16]"
  assert kernel_table.short_name("token_gather_sum_kernel") == "token_gather_sum_kernel"
  assert kernel_table.short_name(
      "sonicmoe_dh_gather_kernel__kernel_CopyAtom_ThrID10_TVLayoutSrc1819201") == "sonicmoe_dh_gather"
  saved = tmp_path / "bench.json"
  saved.write_text(json.dumps(records))
  assert "torch_sonicmoe" in kernel_table.main([str(saved), "--top", "2"])


def test_timed_step_computes_the_forward_output():
  """The fwd+bwd rows time the loss's value with its gradients (as a training step does, and
  as the PyTorch SonicMoE's out.backward runs the whole forward): gradients alone would let
  XLA drop the forward's down-projection and aggregation."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import sonicmoe_jax as sm
  from conftest import make_inputs
  args = make_inputs(0, 64, 32, 16, 4, jnp.float32)
  fn = lambda *a: sm.moe(*a, k=2, backend="xla").out
  dout = jax.random.normal(jax.random.key(1), (64, 32))
  value, grads = bench.forward_backward(fn)(*args, dout)
  np.testing.assert_allclose(value, jnp.sum(fn(*args) * dout), rtol=1e-5)
  want = jax.grad(lambda *a: jnp.sum(fn(*a) * dout), argnums=(0, 1, 2, 3))(*args)
  assert len(grads) == 4
  for g, w in zip(grads, want):   # (one program against op by op: float32 rounding apart)
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))


def test_ncu_step_runs_one_step_of_a_small_layer(capsys):
  """benchmarks.ncu_step (the step Nsight Compute profiles) runs our layer's forward+backward
  at a config given as T,d,n,E,K (off the GPU without the profiler calls)."""
  from benchmarks import ncu_step
  ncu_step.main(["--config", "64,32,16,4,2", "--impl", "xla", "--no-profiler"])
  assert "T64-d32-n16-E4-K2 xla: one step profiled" in capsys.readouterr().out


def test_ncu_sass_top_orders_instructions_by_samples_with_their_context(tmp_path):
  """benchmarks.ncu_sass_top: the most sampled instructions first, each after the ones before
  it, with its share of all samples; a csv that is not a source page is refused."""
  from benchmarks import ncu_sass_top
  header = ["Address", "Source", ncu_sass_top.ALL_SAMPLES, "stall_long_sb", "stall_wait",
            "Instructions Executed"]
  body = [["0x10", "TRYWAIT P0", "5", "0", "5", "100"],
          ["0x20", "@!P0 BRA 0x40", "60", "58", "0", "100"],
          ["0x30", "HGMMA", "10", "0", "2", "400"],
          ["0x40", "NANOSLEEP", "25", "0", "0", "7"]]
  path = tmp_path / "sass.csv"
  path.write_text("\n".join(",".join(f'"{v}"' for v in row)
                            for row in [["Kernel Name", "k"], header, *body]) + "\n")
  lines = ncu_sass_top.top_lines(str(path), top=2, context=1)
  assert lines[0].startswith("# 100 samples")
  assert lines[1] == "--- 60.0% of samples"
  assert "TRYWAIT P0" in lines[2] and "@!P0 BRA 0x40" in lines[3] and " 58 " in lines[3]
  assert lines[4] == "--- 25.0% of samples" and "HGMMA" in lines[5] and "NANOSLEEP" in lines[6]
  assert len(lines) == 7
  other = tmp_path / "other.csv"
  other.write_text('"a","b"\n"c","d"\n"e","f"\n')
  with pytest.raises(ValueError, match="not an ncu source page"):
    ncu_sass_top.top_lines(str(other))


def _autotune_result(shapes, timings):
  """One quack autotuning result: its key's tensor shapes and {GemmConfig text: times}."""
  key = ["False"] + [f"torch.Size({list(s)})" for s in shapes]
  return {"key": key, "configs_timings": [[f"config: GemmConfig({c})", t] for c, t in timings.items()]}


def test_gpu_runner_names_its_modes_before_running_anything(tmp_path):
  """benchmarks/run_gpu.sh refuses an unknown mode up front (exit 2, naming the modes) and
  writes nothing."""
  import os
  import subprocess
  out = tmp_path / "gpu"
  run = subprocess.run(["bash", "benchmarks/run_gpu.sh", "tests", "nosuch"], capture_output=True,
                       text=True, env=dict(os.environ, OUT=str(out)), timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert run.returncode == 2
  assert "nosuch" in run.stderr and "tests, anchors or bench" in run.stderr
  assert not out.exists()


def test_command_lines_explain_every_flag_and_tiny_runs_pass_on_cpu(tmp_path):
  """Every flag of the benchmark and of the demo has help text; off the GPU the benchmark's
  default impls are the ones that run there (no interpreted GPU kernels), and its --tiny run
  with them passes."""
  import jax
  from benchmarks import rounding_bench
  from models import train
  for parser in (bench.build_parser(), train.build_parser(), rounding_bench.build_parser()):
    assert [a.dest for a in parser._actions if not a.help] == []
  if jax.default_backend() != "gpu":
    impls = bench.available_impls()
    assert "pallas" not in impls and "cute" not in impls and "auto" not in impls
    records = bench.main(["--tiny", "--impls", ",".join(i for i in impls if i != "tokamax"),
                          "--iters", "1", "--reps", "1", "--out", str(tmp_path / "tiny")])
    assert all(r["status"] == "ok" for r in records), [(r["impl"], r["status"]) for r in records]


def test_rounding_bench_tiny_times_every_mode_and_tabulates_them(tmp_path):
  from benchmarks import rounding_bench
  records = rounding_bench.main(["--tiny", "--modes", "none,nearest,balanced",
                                 "--out", str(tmp_path)])
  assert [r["mode"] for r in records] == ["none", "nearest", "balanced"]
  assert all(r["step_wall_ms"] > 0 for r in records)
  saved = json.loads((tmp_path / "rounding.json").read_text())
  assert saved["meta"]["commit"] and len(saved["records"]) == 3
  assert "| 512,256,64,8,2 | balanced |" in rounding_bench.table(records)


def test_lowered_step_digests_are_stable_and_see_a_configuration_change():
  """benchmarks.lowered_step: the same code gives the same digests; a kernel configuration
  that changes what compiles changes the kernels' digest (runs on CPU with the cute extra)."""
  import importlib.util
  if importlib.util.find_spec("cutlass") is None:
    pytest.skip("needs the cute extra")
  from benchmarks import lowered_step
  shape = (256, 256, 128, 8, 2)
  first, again = lowered_step.digests(shape), lowered_step.digests(shape)
  assert first == again and first["count"] > 0
  other = lowered_step.digests(shape, backend={"dh": "xla", **{
      op: "cute" for op in ("up_proj", "down_proj", "dx_tilde", "dw1", "dw2")}})
  assert other["kernels"] != first["kernels"] and other["program"] != first["program"]


def test_command_lines_let_jax_take_the_gpu_memory_a_large_layer_needs(monkeypatch):
  """The benchmarks and the demo let JAX take up to 95% of the GPU as it needs it (a
  DeepSeek-V3-size layer needs more than JAX's default 75%), unless the user has set it."""
  import os
  from sonicmoe_jax import memory
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
  memory.take_gpu_memory_as_needed()
  assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"
  assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"     # the user's setting stays
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
  memory.take_gpu_memory_as_needed()
  assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
  with pytest.raises(ValueError, match="fraction"):
    memory.take_gpu_memory_as_needed(1.5)


def test_configs_are_looked_up_by_name_or_given_as_numbers():
  from benchmarks import configs
  assert configs.lookup("gpt-oss-20b") == ("gpt-oss-20b", (32768, 2880, 2880, 32, 4))
  assert configs.lookup("7B-n256")[1] == configs.ANCHORS["7B-n256"]
  assert configs.lookup("64,128,64,8,2") == ("T64-d128-n64-E8-K2", (64, 128, 64, 8, 2))
  with pytest.raises(ValueError, match="unknown config 'gpt-oss'.*qwen3-30b-a3b"):
    configs.lookup("gpt-oss")
