"""Registers, stack frame (spills) and shared memory of the CuTe kernels, read from the sm_90a
cubins CuTe DSL compiles (no GPU needed), and how many CTAs of each fit on one H100/H200 SM.

  python -m benchmarks.kernel_resources [--out FILE]

The variants (kernel, block_n, stages) are compiled in turn in one fresh process with
CUTE_DSL_KEEP=cubin, each adding one cubin; its .nv.info section gives the register count
(EIATTR_REGCOUNT; the ping-pong and gathering kernels' count at launch, before setmaxnreg
moves registers between their warpgroups) and the stack frame (EIATTR_FRAME_SIZE: non-zero
means registers spilled to local memory). The kernels' shared memory is the pipeline's stages
plus 1 KiB of barriers (mainloop.smem_bytes) at the depth the kernel runs
(grouped_gemm.pipeline_depth; the compiled shapes have K_STEPS k steps, enough for any depth).
CTAs per SM = min(by registers: 64K / (threads x registers rounded up to 8), by SMEM: 227 KiB /
the CTA's SMEM). Each record also has its cubin's sha256: two runs' kernel_resources.json
(--out), before and after a change, show whether it left each kernel's machine code as it was.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import struct
import subprocess
import sys
import tempfile

from benchmarks import output

REGISTERS_PER_SM = 65536
K_STEPS = 8   # k steps of the compiled shapes (K = P = K_STEPS * BLOCK_K): the deepest pipeline
SMEM_PER_SM = 227 * 1024
_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE = 0x2F, 0x11

# (name, kernel, block_n, stages or 0 for as many as fit); shapes are small: resources do not
# depend on them
VARIANTS = [
    ("store bn128 st3", "matmul", 128, 3), ("store bn256 fit", "matmul", 256, 0),
    ("up_proj bn128 fit", "up_proj", 128, 0), ("up_proj gather bn128 fit", "up_proj_gather", 128, 0),
    ("dh bn64 fit", "dh", 64, 0), ("dh bn128 fit", "dh", 128, 0), ("dh bn128 st3", "dh", 128, 3),
    ("dh bn256 fit", "dh", 256, 0), ("dh tma bn128 fit", "dh_tma", 128, 0),
    ("dh gather bn128 fit", "dh_gather", 128, 0), ("dh gather bn256 fit", "dh_gather", 256, 0),
    ("dh h_smem bn256 fit", "dh_h_smem", 256, 0),
    ("dh gather h_smem bn256 fit", "dh_gather_h_smem", 256, 0),
    ("dh tma h_smem bn256 fit", "dh_tma_h_smem", 256, 0),
    ("dh gather tma h_smem bn256 fit", "dh_gather_tma_h_smem", 256, 0),   # the default, d > 1536
    ("wgrad bn128 st3", "wgrad", 128, 3),
    ("wgrad bn256 fit", "wgrad", 256, 0), ("wgrad gather bn128 st3", "wgrad_gather", 128, 3),
    ("wgrad gather bn256 fit", "wgrad_gather", 256, 0),
    ("store pingpong bn128 fit", "matmul_pingpong", 128, 0),
    ("store pingpong tma bn128 fit", "matmul_pingpong_tma", 128, 0),
    ("store pingpong tma bn192 fit", "matmul_pingpong_tma", 192, 0),
    ("store pingpong tma bn192 cluster2 fit", "matmul_pingpong_tma_cluster2", 192, 0),
    ("store pingpong tma 192-row bn128 fit", "matmul_pingpong_tma_rows192", 128, 0),
    ("dh pingpong bn128 fit", "dh_pingpong", 128, 0), ("dh pingpong bn64 fit", "dh_pingpong", 64, 0),
    ("dh pingpong gather bn128 fit", "dh_pingpong_gather", 128, 0),
    ("dh pingpong gather tma bn128 fit", "dh_pingpong_gather_tma", 128, 0),   # d <= 1536
    ("up_proj pingpong bn64 fit", "up_proj_pingpong", 64, 0),
    ("store ws bn256 fit", "matmul_ws", 256, 0), ("up_proj ws bn128 fit", "up_proj_ws", 128, 0),
    ("dh ws bn256 fit", "dh_ws", 256, 0), ("wgrad ws bn256 fit", "wgrad_ws", 256, 0),
    ("wgrad persistent gather bn128 fit", "wgrad_persistent_gather", 128, 0),
    ("wgrad persistent gather bn256 fit", "wgrad_persistent_gather", 256, 0),
    ("wgrad persistent gather dynamic bn256 fit", "wgrad_persistent_gather_dynamic", 256, 0),
    ("wgrad persistent gather cluster bn256 fit", "wgrad_persistent_gather_cluster", 256, 0),
    ("wgrad persistent gather dynamic cluster bn256 fit",
     "wgrad_persistent_gather_dynamic_cluster", 256, 0),
    ("wgrad persistent gather tmarows cluster bn256 fit",   # the default dW2; dW1 where static
     "wgrad_persistent_gather_cluster_tmarows", 256, 0),
    ("wgrad persistent gather tmarows dynamic cluster bn256 fit",   # the default dW1, many tiles
     "wgrad_persistent_gather_dynamic_cluster_tmarows", 256, 0),
    ("store persistent bn256 fit", "matmul_persistent", 256, 0),
]

# Compiles each (kernel, block_n, stages) of the JSON list argv[2] in turn (argv[1]: the cubins'
# dump directory), printing after each the cubins it added (moved to kept/<i>/), as one JSON
# line.
_COMPILE = """
import json, pathlib, sys
import ffi  # noqa: F401  (CUTE_DSL_ARCH=sm_90a off the GPU)
import jax, jax.numpy as jnp
from ffi import grouped_gemm as g, persistent as pw, pingpong as pp
from sonicmoe_jax.core import schedule

from benchmarks import output
dump, variants, k_steps = pathlib.Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
P = K = k_steps * g.BLOCK_K
sds = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt)


def variant(kernel, bn, stages):
  N, E = (768 if bn == 192 else 512), 4   # (192-wide tiles need N a multiple of 192)
  kw = dict(block_n=bn, stages=stages or None)
  if kernel.endswith("_tmarows"):   # the persistent weight gradient's gathered rows by TMA
    kernel, kw["tma_gather"] = kernel.removesuffix("_tmarows"), True
  if kernel.endswith("_h_smem"):   # dh's epilogue reading H from SMEM
    kernel, kw["h_smem"] = kernel.removesuffix("_h_smem"), True
  if kernel.endswith("_ws"):   # a kernel that does not gather, warp-specialized
    kernel, kw["warp_specialized"] = kernel.removesuffix("_ws"), True
  if kernel.endswith("_cluster"):   # the persistent weight gradient in clusters of 2
    kernel, kw["cluster_m"] = kernel.removesuffix("_cluster"), 2
  if kernel.endswith("_dynamic"):   # the persistent weight gradient's dynamic tile order
    kernel, kw["dynamic"] = kernel.removesuffix("_dynamic"), True
  return {
    "matmul": (lambda a, b, t: g.grouped_matmul(a, b, t, **kw), (sds(P, K), sds(E, K, N), sds(P // 128, dt=jnp.int32))),
    "up_proj": (lambda a, b, t: g.up_proj(a, b, t, **kw), (sds(P, K), sds(E, K, N), sds(P // 128, dt=jnp.int32))),
    "up_proj_gather": (lambda a, b, t, i: g.up_proj(a, b, t, gather_index=i, **kw),
                       (sds(300, K), sds(E, K, N), sds(P // 128, dt=jnp.int32), sds(P, dt=jnp.int32))),
    "dh": (lambda a, w, h, s, t: g.dh(a, w, h, s, t, **kw),
           (sds(P, K), sds(E, N // 2, K), sds(P, N), sds(P, dt=jnp.float32), sds(P // 128, dt=jnp.int32))),
    "dh_tma": (lambda a, w, h, s, t: g.dh(a, w, h, s, t, tma_store=True, **kw),
               (sds(P, K), sds(E, N // 2, K), sds(P, N), sds(P, dt=jnp.float32), sds(P // 128, dt=jnp.int32))),
    "dh_gather": (lambda a, w, h, s, t, i: g.dh(a, w, h, s, t, gather_index=i, **kw),
                  (sds(300, K), sds(E, N // 2, K), sds(P, N), sds(P, dt=jnp.float32),
                   sds(P // 128, dt=jnp.int32), sds(P, dt=jnp.int32))),
    "dh_gather_tma": (lambda a, w, h, s, t, i: g.dh(a, w, h, s, t, gather_index=i, tma_store=True,
                                                    **kw),
                      (sds(300, K), sds(E, N // 2, K), sds(P, N), sds(P, dt=jnp.float32),
                       sds(P // 128, dt=jnp.int32), sds(P, dt=jnp.int32))),
    "matmul_pingpong": (lambda a, b, t: pp.grouped_matmul(a, b, t, **kw),
                        (sds(P, K), sds(E, K, N), sds(P // 128, dt=jnp.int32))),
    "matmul_pingpong_tma": (lambda a, b, t: pp.grouped_matmul(a, b, t, tma_store=True, **kw),
                            (sds(P, K), sds(E, K, N), sds(P // 128, dt=jnp.int32))),
    "matmul_pingpong_tma_cluster2": (   # clusters of 2 along N (N / bn: 4 column tiles)
        lambda a, b, t: pp.grouped_matmul(a, b, t, tma_store=True, cluster_n=2, **kw),
        (sds(P, K), sds(E, K, N), sds(P // 128, dt=jnp.int32))),
    "matmul_pingpong_tma_rows192": (  # 192-row tiles: schedule.row_tiles' table
        lambda a, b, t: pp.grouped_matmul(a, b, t, tma_store=True, tile_m=192, **kw),
        (sds(P, K), sds(E, K, N), sds(schedule.ROW_TILE_FIELDS * schedule.row_tile_entries(
            P, E, pp.ROW_TILE_M), dt=jnp.int32))),
    "dh_pingpong": (lambda a, w, h, s, t: pp.dh(a, w, h, s, t, **kw),
                    (sds(P, K), sds(E, N // 2, K), sds(P, N), sds(P, dt=jnp.float32), sds(P // 128, dt=jnp.int32))),
    "dh_pingpong_gather": (lambda a, w, h, s, t, i: pp.dh(a, w, h, s, t, gather_index=i, **kw),
                           (sds(300, K), sds(E, N // 2, K), sds(P, N), sds(P, dt=jnp.float32),
                            sds(P // 128, dt=jnp.int32), sds(P, dt=jnp.int32))),
    "dh_pingpong_gather_tma": (lambda a, w, h, s, t, i: pp.dh(a, w, h, s, t, gather_index=i,
                                                              tma_store=True, **kw),
                               (sds(300, K), sds(E, N // 2, K), sds(P, N), sds(P, dt=jnp.float32),
                                sds(P // 128, dt=jnp.int32), sds(P, dt=jnp.int32))),
    "up_proj_pingpong": (lambda a, b, t, i: pp.up_proj(a, b, t, i, **kw),
                         (sds(300, K), sds(E, K, N), sds(P // 128, dt=jnp.int32), sds(P, dt=jnp.int32))),
    "wgrad": (lambda a, b, o: g.weight_grad(a, b, o, E, **kw), (sds(P, K), sds(P, N), sds(E + 1, dt=jnp.int32))),
    "wgrad_gather": (lambda a, b, o, i: g.weight_grad(a, b, o, E, gather_index=i, **kw),
                     (sds(300, K), sds(P, N), sds(E + 1, dt=jnp.int32), sds(P, dt=jnp.int32))),
    "matmul_persistent": (lambda a, b, t: pw.grouped_matmul(a, b, t, **kw),
                          (sds(P, K), sds(E, K, N), sds(P // 128, dt=jnp.int32))),
    "wgrad_persistent_gather": (lambda a, b, o, i: pw.weight_grad(a, b, o, E, i, **kw),
                                (sds(300, K), sds(P, N), sds(E + 1, dt=jnp.int32), sds(P, dt=jnp.int32))),
}[kernel]


kept = dump / "kept"   # each variant's cubins moved here (their names can repeat)
for i, (kernel, bn, stages) in enumerate(variants):
  fn, args = variant(kernel, bn, stages)
  jax.jit(fn).trace(*args)
  (kept / str(i)).mkdir(parents=True)
  new = [str(p.rename(kept / str(i) / p.name)) for p in dump.rglob("*.cubin") if kept not in p.parents]
  print(json.dumps(new), flush=True)
"""


def _sections(data: bytes):
  """{name: (offset, size)} of an ELF64 file's sections."""
  shoff, = struct.unpack_from("<Q", data, 0x28)
  shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
  headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
  names_at = headers[shstrndx][4]
  name = lambda h: data[names_at + h[0]:data.index(b"\0", names_at + h[0])].decode()
  return {name(h): (h[4], h[5]) for h in headers}


def cubin_resources(data: bytes) -> dict:
  """{"registers": n, "stack_bytes": n} (the largest over the cubin's functions)."""
  offset, size = _sections(data)[".nv.info"]
  found = {_EIATTR_REGCOUNT: 0, _EIATTR_FRAME_SIZE: 0}
  p = offset
  while p < offset + size:
    fmt, attr = data[p], data[p + 1]
    if fmt == 0x04:   # an attribute with a sized payload: (function symbol, value) for ours
      length, = struct.unpack_from("<H", data, p + 2)
      if attr in found:
        found[attr] = max(found[attr], struct.unpack_from("<II", data, p + 4)[1])
      p += 4 + length
    else:             # 0x03: a 2-byte value; 0x01/0x02: none
      p += 4 if fmt == 0x03 else 2
  return {"registers": found[_EIATTR_REGCOUNT], "stack_bytes": found[_EIATTR_FRAME_SIZE]}


def measure_many(variants) -> list[dict]:
  """Compiles each (kernel, block_n, stages) in turn in one fresh process and reads the one
  cubin each adds: cubin_resources per variant, in order, with the cubin's sha256 (the same
  digests before and after a change: the change leaves the machine code as it was)."""
  repo = pathlib.Path(__file__).resolve().parent.parent
  variants = [list(v) for v in variants]
  with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ, CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=tmp, SONICMOE_CUTE_CACHE="",
               PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _COMPILE, tmp, json.dumps(variants), str(K_STEPS)],
                          env=env, cwd=tmp, check=True, capture_output=True, text=True,
                          timeout=300 + 120 * len(variants))
    added = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
    resources = []
    for (kernel, block_n, _), cubins in zip(variants, added, strict=True):
      if len(cubins) != 1:
        raise RuntimeError(f"expected one cubin for {kernel} at block_n={block_n}, found {len(cubins)}")
      data = pathlib.Path(cubins[0]).read_bytes()
      resources.append(dict(cubin_resources(data), cubin_sha256=hashlib.sha256(data).hexdigest()))
    return resources


def smem_bytes(kernel: str, block_n: int, stages: int) -> int:
  """The variant's SMEM at the pipeline depth its kernel runs (stages 0: as many as fit)."""
  from ffi import grouped_gemm as g, mainloop, persistent as pw, pingpong as pp
  num_rhs = 2 if kernel.startswith("up_proj") else 1
  if "persistent" in kernel:   # the ring beside the epilogue's own buffers
    depth = stages or min(pw.stages_that_fit(block_n, 2), K_STEPS)
    return mainloop.smem_bytes(block_n, 1, 2, depth) + pw.epilogue_bytes(2)
  if "pingpong" in kernel:
    tile_m = pp.ROW_TILE_M if kernel.endswith("_rows192") else pp.TILE_M
    tma_store = kernel.removesuffix("_rows192").removesuffix("_cluster2").endswith("_tma")
    kind = "dh" if kernel.startswith("dh") else "store"
    depth = stages or pp.stages_that_fit(block_n, 2, num_rhs, tma_store, kind, tile_m)
    return (mainloop.smem_bytes(block_n, num_rhs, 2, depth, rows=tile_m)
            + (pp.epilogue_bytes(2, kind, tile_m) if tma_store else 0))
  depth = g.pipeline_depth(block_n, num_rhs, 2, K_STEPS, stages or None)
  return mainloop.smem_bytes(block_n, num_rhs, 2, depth)


def threads(kernel: str) -> int:
  """The variant's threads per CTA."""
  from ffi import mainloop, pingpong as pp
  if "pingpong" in kernel:
    return pp.THREADS
  base = kernel.removesuffix("_tmarows").removesuffix("_cluster").removesuffix("_dynamic")
  producer = base.endswith(("_gather", "_ws", "_persistent"))   # + the producer warpgroup
  return mainloop.THREADS + (128 if producer else 0)


def ctas_per_sm(registers: int, smem: int, threads: int) -> int:
  by_registers = REGISTERS_PER_SM // (threads * ((registers + 7) // 8 * 8))
  return min(by_registers, SMEM_PER_SM // smem)


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", default=None, help="folder to write kernel_resources.json into (default: none written)")
  p.add_argument("--only", default="", help="variants whose name contains this text")
  a = p.parse_args(argv)
  import ffi  # noqa: F401
  recs = []
  chosen = [v for v in VARIANTS if a.only in v[0]]
  for (name, kernel, block_n, stages), found in zip(chosen, measure_many([v[1:] for v in chosen])):
    rec = dict(variant=name, **found, smem_bytes=smem_bytes(kernel, block_n, stages))
    rec["ctas_per_sm"] = ctas_per_sm(rec["registers"], rec["smem_bytes"], threads(kernel))
    recs.append(rec)
    print(json.dumps(rec), flush=True)
  width = max([len("variant")] + [len(r["variant"]) for r in recs])
  print(f"{'variant':{width}s} {'regs':>5s} {'stack B':>8s} {'SMEM KiB':>9s} {'CTAs/SM':>8s}")
  for r in recs:
    print(f"{r['variant']:{width}s} {r['registers']:5d} {r['stack_bytes']:8d} "
          f"{r['smem_bytes'] / 1024:9.1f} {r['ctas_per_sm']:8d}")
  if a.out:
    output.write_json(a.out, "kernel_resources", recs)


if __name__ == "__main__":
  main()
