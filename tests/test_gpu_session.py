"""benchmarks/gpu_session.sh, the device calls' script: it parses, documents every mode,
carries the PyTorch SonicMoE's caches from one machine to the next (torch_cache_save, then the
restore at the start of a later run), keeps its autotuner's picks after torch_warm, and splits
the cute GPU tests (tests/test_cute_*.py) into parts. Runs on the CPU: no mode here needs a GPU."""
import os
import pathlib
import re
import subprocess

from sonicmoe_jax import backends

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh"


def test_gpu_session_parses_and_documents_every_mode():
  subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
  text = SCRIPT.read_text()
  header = text.split("set -uo pipefail")[0]
  modes = re.findall(r"^    ([a-z_0-9]+)\)", text, re.M)
  documented = re.findall(r"^#   ([a-z_0-9]+)\s*:", header, re.M)
  assert len(modes) > 20 and "pair_rounds" in modes and "torch_cache_save" in modes
  assert sorted(modes) == sorted(documented)


def _run(cwd, home, tmp, out, *modes, **settings):
  env = dict(os.environ, HOME=str(home), TMPDIR=str(tmp), OUT=str(out), **settings)
  return subprocess.run(["bash", str(SCRIPT), *modes], cwd=cwd, env=env, capture_output=True,
                        text=True, timeout=120)


_TUNED = '{"key": ["2048"], "configs_timings": []}'


def _autotuned(home):
  """A quack autotuning result (_TUNED) under home's ~/.quack, as a run leaves one; its path."""
  tuned = home / ".quack" / "cache" / "KEY" / "gemm.autotune.json"
  tuned.parent.mkdir(parents=True)
  tuned.write_text(_TUNED)
  return tuned


def test_torch_caches_saved_then_restored_on_a_fresh_machine(tmp_path):
  """torch_cache_save writes quack's autotuning results (~/.quack) and its compiled kernels (the
  temp folder's <user>/quack_cache, split into 15 MiB parts) under $OUT; with those files in
  DEVCACHE's folder (.devcache/ unless named) a later run restores both, byte for byte, once
  per machine."""
  import getpass
  user = getpass.getuser()
  old_home, old_tmp = tmp_path / "home1", tmp_path / "tmp1"
  tuned = _autotuned(old_home)
  kernels = old_tmp / user / "quack_cache"
  kernels.mkdir(parents=True)
  big = os.urandom(17 * 2**20)   # more than one 15 MiB part
  (kernels / "gemm.o").write_bytes(big)
  out = tmp_path / "out"
  saved = _run(tmp_path, old_home, old_tmp, out, "torch_cache_save")
  assert saved.returncode == 0, saved.stderr
  parts = sorted(p.name for p in out.glob("quack_kernels.tgz.part*"))
  assert parts == ["quack_kernels.tgz.part00", "quack_kernels.tgz.part01"]

  repo = tmp_path / "repo"
  (repo / ".devcache-h100").mkdir(parents=True)   # a card's own folder (DEVCACHE)
  for f in out.glob("quack_*"):
    (repo / ".devcache-h100" / f.name).write_bytes(f.read_bytes())
  new_home, new_tmp = tmp_path / "home2", tmp_path / "tmp2"
  new_home.mkdir()
  new_tmp.mkdir()
  assert "restored" not in _run(repo, new_home, new_tmp, tmp_path / "out1").stdout   # no .devcache
  restored = _run(repo, new_home, new_tmp, tmp_path / "out2", DEVCACHE=".devcache-h100")
  assert restored.returncode == 0, restored.stderr
  assert "1 autotuning results, 1 kernel files" in restored.stdout
  assert (new_home / ".quack" / "cache" / "KEY" / "gemm.autotune.json").read_text() == tuned.read_text()
  assert (new_tmp / user / "quack_cache" / "gemm.o").read_bytes() == big
  # once per machine: a second run leaves a changed cache alone
  (new_tmp / user / "quack_cache" / "gemm.o").write_bytes(b"newer")
  again = _run(repo, new_home, new_tmp, tmp_path / "out3", DEVCACHE=".devcache-h100")
  assert "restored" not in again.stdout
  assert (new_tmp / user / "quack_cache" / "gemm.o").read_bytes() == b"newer"


def test_torch_warm_saves_the_autotuners_picks(tmp_path):
  """torch_warm keeps quack's autotuning results of the machine it ran on ($OUT's
  quack_autotune.tgz, which benchmarks.torch_autotune reads) even where its run fails (here:
  no PyTorch SonicMoE staged)."""
  from benchmarks import torch_autotune
  home = tmp_path / "home"
  _autotuned(home)
  # it runs in the checkout: the restore marker keeps a local .devcache/ (git-ignored) out
  (tmp_path / ".quack-restored").touch()
  out = tmp_path / "out"
  result = _run(SCRIPT.parents[1], home, tmp_path, out, "torch_warm", TORCH_CONFIGS="7B-n256")
  assert result.returncode == 0, result.stderr
  assert "torch_warm: rc " in result.stdout and "quack_autotune.tgz saved" in result.stdout
  assert torch_autotune.read_results(str(out / "quack_autotune.tgz")) == [
      ("gemm", {"key": ["2048"], "configs_timings": []})]


def test_unknown_mode_fails(tmp_path):
  result = _run(tmp_path, tmp_path, tmp_path, tmp_path / "out", "no_such_mode")
  assert result.returncode == 2 and "unknown mode no_such_mode" in result.stderr


def test_cute_mode_runs_every_nth_of_test_cutes_gpu_tests(tmp_path):
  """`cute` lists the cute GPU tests and runs every CUTE_PARTS-th from the CUTE_PART-th
  (off the GPU they skip); without the cute wheels it stops at once (exit 3)."""
  out = tmp_path / "out"
  result = _run(SCRIPT.parents[1], tmp_path, tmp_path, out, "cute", CUTE_PART="2", CUTE_PARTS="60")
  if not backends._cute_installed():
    assert result.returncode == 3 and "not staged" in result.stdout
    return
  ids = (out / "cute_test_ids.txt").read_text().split()
  part = ids[1::60]
  assert len(ids) > 100 and all(i.startswith("tests/test_cute_") for i in ids)
  assert (out / "cute_part2.txt").read_text().split() == part
  assert f"part 2 of 60, {len(part)} of {len(ids)} tests" in result.stdout
  log = (out / "pytest_cute_part2.log").read_text()
  assert re.search(rf"\b{len(part)} (passed|skipped)", log), log[-500:]


def _wheel_of(module, wheels):
  """A stand-in wheel (a zip of the installed package and its dist-info) of module's
  distribution into the folder wheels."""
  import importlib.metadata
  import zipfile
  dist = importlib.metadata.distribution(importlib.metadata.packages_distributions()[module][0])
  root = pathlib.Path(dist.locate_file(""))
  with zipfile.ZipFile(wheels / f"{dist.metadata['Name']}.whl", "w") as wheel:
    for f in dist.files:
      if "__pycache__" not in f.parts:
        wheel.write(root / f, str(f))


def test_cute_all_mode_runs_test_cutes_gpu_tests_in_xdist_workers(tmp_path):
  """`cute_all` unpacks the pytest-xdist wheels it is given and runs all of the cute GPU
  tests in CUTE_WORKERS processes (off the GPU they skip); without the cute wheels, or without
  xdist's, it stops at once (exit 3)."""
  (tmp_path / ".quack-restored").touch()   # (keeps a local .devcache/ out)
  wheels = tmp_path / "wheels"
  wheels.mkdir()
  run = lambda: _run(SCRIPT.parents[1], tmp_path, tmp_path, tmp_path / "out", "cute_all",
                     XDIST_WHEELS=str(wheels), CUTE_WORKERS="2")
  result = run()
  if not backends._cute_installed():
    assert result.returncode == 3 and "not staged" in result.stdout
    return
  assert result.returncode == 3 and f"no {wheels}/*.whl" in result.stdout
  _wheel_of("xdist", wheels)
  _wheel_of("execnet", wheels)
  result = run()
  log = (tmp_path / "out" / "pytest_cute_all.log").read_text()
  assert "cute_all: rc 0" in result.stdout, log[-500:]
  assert (tmp_path / "xdist-site" / "xdist" / "plugin.py").exists()
  assert "bringing up nodes" in log and re.search(r"\b\d{3} skipped", log), log[-500:]


def test_torch_cache_save_without_caches_says_so(tmp_path):
  """On a machine where the PyTorch SonicMoE never ran there is nothing to save: no files."""
  result = _run(tmp_path, tmp_path / "empty_home", tmp_path, tmp_path / "out", "torch_cache_save")
  assert not list((tmp_path / "out").glob("quack_*"))
  assert "not saved" in result.stdout + result.stderr


def test_join_records_writes_a_pair_and_appends_rounds(tmp_path):
  """pair's and pair_rounds' join of ours (a JSON list) and theirs (JSON lines): a pair
  overwrites its file; rounds append, each record tagged; a missing file adds nothing."""
  import json
  body = re.search(r"^join_records\(\) \{.*?\"\$@\"; \}$", SCRIPT.read_text(), re.M | re.S).group(0)
  (tmp_path / "ours.json").write_text('[{"impl": "auto"}]')
  (tmp_path / "theirs.jsonl").write_text('{"impl": "torch"}\n\n')
  calls = ["join_records pair.json ours.json theirs.jsonl",
           "join_records pair.json ours.json theirs.jsonl",
           "join_records rounds.json ours.json theirs.jsonl 1",
           "join_records rounds.json ours.json missing.jsonl 2"]
  subprocess.run(["bash", "-c", body + "\n" + "\n".join(calls)], cwd=tmp_path, check=True)
  assert json.loads((tmp_path / "pair.json").read_text()) == [{"impl": "auto"}, {"impl": "torch"}]
  assert json.loads((tmp_path / "rounds.json").read_text()) == [
      {"impl": "auto", "round": 1}, {"impl": "torch", "round": 1}, {"impl": "auto", "round": 2}]


def test_setting_rounds_runs_each_variant_in_turn_and_tables_them(tmp_path):
  """setting_rounds: bench under each of SETTINGS' variants in turn for SETTING_ROUNDS rounds
  (a stand-in bench here writes what the real one would), every record tagged with its round
  in one JSON, and kernel_table's rows one per variant with the medians of its rounds."""
  import json
  import sys
  fake_bench = tmp_path / "fake_bench.py"
  fake_bench.write_text(
      "import json, sys\n"
      "a = sys.argv[1:]\n"
      "min_k = int(a[a.index('--cute-store-wide-min-k') + 1])\n"
      "dx = min_k / 1024\n"
      "rec = dict(config=a[a.index('--configs') + 1], impl='auto', status='ok',\n"
      "           cute_settings={'STORE_WIDE_MIN_K': min_k}, kernel_fwd_ms=1.0,\n"
      "           kernel_fwd_bwd_ms=3.0, fwd_ms=1.5, fwd_bwd_ms=3 + dx, act_bytes=0, step_bytes=0,\n"
      "           kernels_fwd_bwd=[['x', 0]], kernel_launches_fwd_bwd=[\n"
      "               ['sonicmoe_dh_gather_kernel__k', 0.7], ['sonicmoe_pingpong_matmul_kernel__k', dx]])\n"
      "json.dump([rec], open(a[a.index('--out') + 1] + '.json', 'w'))\n")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  python3 = bin_dir / "python3"
  python3.write_text("#!/usr/bin/env bash\n"
                     f'if [ "$1 $2" = "-m benchmarks.bench" ]; then shift 2; exec {sys.executable} {fake_bench} "$@"; fi\n'
                     f'exec {sys.executable} "$@"\n')
  python3.chmod(0o755)
  out = tmp_path / "out"
  env = dict(os.environ, HOME=str(tmp_path), TMPDIR=str(tmp_path), OUT=str(out),
             PATH=f"{bin_dir}:{os.environ['PATH']}", SETTING_ROUNDS="2", SETTING_CONFIGS="7B-n256",
             SETTINGS="--cute-store-wide-min-k 2048|--cute-store-wide-min-k 4096")
  result = subprocess.run(["bash", str(SCRIPT), "setting_rounds"], cwd=SCRIPT.parents[1], env=env,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  records = json.loads((out / "setting_rounds.json").read_text())
  assert [(r["round"], r["cute_settings"]["STORE_WIDE_MIN_K"]) for r in records] == [
      (1, 2048), (1, 4096), (2, 2048), (2, 4096)]
  rows = [line.split() for line in result.stdout.splitlines() if line.startswith("7B-n256")]
  assert [row[1] for row in rows] == ["auto[STORE_WIDE_MIN_K=2048]", "auto[STORE_WIDE_MIN_K=4096]"] * 2
  assert rows[0][2] == "2" and rows[0][6] == "2.000" and rows[1][6] == "4.000"   # dX~ medians
  assert rows[2][6] == "5.000" and rows[3][6] == "7.000"   # the step's wall f+b medians
