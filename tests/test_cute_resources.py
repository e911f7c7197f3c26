"""What the compiled cute kernels use, read from their sm_90a cubins (no GPU): registers,
spills, SMEM and CTAs per SM (benchmarks/kernel_resources.py), and the setmaxnreg budgets."""

from cute_helpers import needs_cute


@needs_cute
def test_setmaxnreg_budgets_fit_what_the_cta_gets_at_launch():
  """Every warp-specialized kernel's (producer, MMA warpgroups) register budgets fit the
  384-thread CTA's launch allocation (168 registers a thread): a consumer's setmaxnreg
  increase past it waits for ever (48 / 232 hung the ping-pong dH on an H200)."""
  from ffi import mainloop, pingpong
  launch = pingpong.THREADS * 168
  budgets = [*pingpong.REGISTERS.values(), pingpong.SMEM_EPILOGUE_GATHER_REGISTERS,
             (mainloop.PRODUCER_REGISTERS, mainloop.MMA_REGISTERS)]
  for producer, consumers in budgets:
    assert producer % 8 == 0 and consumers % 8 == 0, (producer, consumers)
    assert 128 * producer + 256 * consumers <= launch, (producer, consumers)


@needs_cute
def test_kernel_resources_keep_the_tiles_ffi_ops_relies_on():
  """From the sm_90a cubins: the store GEMMs' tile (block_n 128, 3 stages) fits two CTAs per SM
  (what CuteConfig.store_stages is for), and the dH kernel at block_n 128 does not spill in
  at most 128 registers (the other kernels' spills: KERNEL_SPILLS)."""
  from benchmarks import kernel_resources as kr
  from ffi import mainloop
  store, dh = kr.measure_many([("matmul", 128, 3), ("dh", 128, 0)])
  assert kr.ctas_per_sm(store["registers"], kr.smem_bytes("matmul", 128, 3), mainloop.THREADS) == 2
  assert dh["stack_bytes"] == 0 and 0 < dh["registers"] <= 128


# (kernel_resources variant, block_n, the stack frame in bytes it may have): the ping-pong
# kernels at the tiles ffi/ops.py runs them with (dH 128, reading or gathering dO; up_proj 64;
# the store GEMMs 128, and 192 with TMA stores: 192 accumulator registers, as their 192-row
# tiles at 128) and the defaults
# (ffi/config.py's choices) at their tiles. The ping-pong dH gathering dO with its SMEM epilogue
# (the default where d <= 1536) has spilled 40 bytes (10 registers of its MMA warpgroups: at
# the (56, 224) register split 80, at (24, 240) 8) since the SwiGLU sigmoid moved to
# ex2/rcp.approx, which is faster all the same (and (24, 240) runs slower); more than that is
# a regression. The others may not spill.
KERNEL_SPILLS = [("dh_pingpong", 128, 0), ("dh_pingpong_gather", 128, 0),
                 ("up_proj_pingpong", 64, 0), ("matmul_pingpong", 128, 0),
                 ("matmul_pingpong_tma", 128, 0), ("matmul_pingpong_tma", 192, 0),
                 ("matmul_pingpong_tma_rows192", 128, 0),
                 ("up_proj_gather", 128, 0), ("dh_gather_tma_h_smem", 256, 0),
                 ("dh_pingpong_gather_tma", 128, 40), ("wgrad_persistent_gather", 256, 0),
                 ("wgrad_persistent_gather_cluster_tmarows", 256, 0),
                 ("wgrad_persistent_gather_dynamic_cluster_tmarows", 256, 0),
                 ("matmul_persistent", 256, 0)]


@needs_cute
def test_kernels_spill_no_more_than_recorded():
  """A new spill shows in the cubin's stack frame before it shows on a GPU (all of
  KERNEL_SPILLS compiled in one process: one import of JAX and CuTe DSL, not one each)."""
  from benchmarks import kernel_resources as kr
  found = kr.measure_many([(kernel, block_n, 0) for kernel, block_n, _ in KERNEL_SPILLS])
  over = [(kernel, block_n, got["stack_bytes"], max_stack)
          for (kernel, block_n, max_stack), got in zip(KERNEL_SPILLS, found)
          if got["stack_bytes"] > max_stack]
  assert not over, f"(kernel, block_n, stack bytes, recorded most): {over}"
  assert all(got["registers"] > 0 for got in found)


@needs_cute
def test_kernel_resources_writes_its_records(tmp_path, monkeypatch):
  """--out writes the printed records to kernel_resources.json (the cubins' measurements
  stood in for: this checks the command, not the compiler)."""
  import json
  from benchmarks import kernel_resources as kr
  fake = dict(registers=128, stack_bytes=0, cubin_sha256="0" * 64)
  monkeypatch.setattr(kr, "measure_many", lambda variants: [dict(fake) for _ in variants])
  monkeypatch.setattr(kr, "smem_bytes", lambda kernel, block_n, stages: 1024 * block_n)
  kr.main(["--only", "store bn", "--out", str(tmp_path)])
  records = json.loads((tmp_path / "kernel_resources.json").read_text())
  names = [r["variant"] for r in records]
  assert names == [v[0] for v in kr.VARIANTS if "store bn" in v[0]] and names
  assert all(r["registers"] == 128 and r["smem_bytes"] > 0 for r in records)
