"""Correctness of a backend at the anchor configs on the GPU, against independent references
that fit at these sizes (the xla backend does not run there: XLA's ragged_dot fails):
  * forward O_t and dX_t for sampled tokens: a per-token float32 computation over the token's
    own experts (dX_t by autodiff of that per-token function, router path included);
  * dW1_e, dW2_e for sampled experts: dense float32 GEMMs over the expert's rows;
  * every output finite; padding rows of H zero.
Prints one line per config and writes JSON.  python -m benchmarks.check_anchors --backend pallas
"""
from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

import sonicmoe_jax as sm
from benchmarks import configs as C
from benchmarks import output
from benchmarks.bench import backend_spec, make_args

F32 = jnp.float32


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def token_output(x_t, wr, w1, w2, experts, mask, k):
  """O_t for one token over its expert set (float32; experts [J] with mask [J] marking the
  real ones), scores as softmax over the top-k logits."""
  logits = x_t.astype(F32) @ wr.astype(F32)
  s = jnp.where(mask, jnp.exp(logits[experts] - jax.nn.logsumexp(jax.lax.top_k(logits, k)[0])), 0.0)
  n = w2.shape[1]
  h = jnp.einsum("d,kdf->kf", x_t.astype(F32), w1[experts].astype(F32))
  a = jax.nn.silu(h[:, :n]) * h[:, n:]
  return jnp.einsum("k,kn,knd->d", s, a, w2[experts].astype(F32))


@functools.partial(jax.jit, static_argnames="k")
def token_references(x_t, dout_t, wr, w1, w2, experts, mask, *, k):
  """(O_t, dX_t) in float32 for a batch of tokens, each over its own experts [J] (mask [J])."""
  def one(xt, dt, ex, m):
    o, vjp = jax.vjp(lambda v: token_output(v, wr, w1, w2, ex, m, k), xt)
    return o, vjp(dt)[0]
  return jax.vmap(one)(x_t.astype(F32), dout_t.astype(F32), experts, mask)


@jax.jit
def expert_weight_grads(xe, doe, s, w1_e, w2_e):
  """(dW1_e, dW2_e) in float32 from the expert's rows (padding rows zero)."""
  n = w2_e.shape[0]
  he = xe @ w1_e.astype(F32)
  g, u = he[:, :n], he[:, n:]
  sig = jax.nn.sigmoid(g)
  da = s * (doe @ w2_e.astype(F32).T)
  dh = jnp.concatenate([da * u * sig * (1 + g * (1 - sig)), da * g * sig], axis=1)
  return xe.T @ dh, (s * jax.nn.silu(g) * u).T @ doe


def check(name, cfg, backend, rounding, num_tokens=16, num_experts=2, windows=None):
  T, d, n, E, K = cfg
  (x, wr, w1, w2), dout = make_args(T, d, n, E, K)
  kw = dict(k=K, rounding=rounding, tile=128, backend=backend_spec(backend), windows=windows)

  @jax.jit
  def fwd_bwd(x, wr, w1, w2):
    res, vjp = jax.vjp(lambda *a: sm.moe(*a, **kw).out, x, wr, w1, w2)
    return res, vjp(dout)
  out, (dx, dwr, dw1, dw2) = fwd_bwd(x, wr, w1, w2)
  ops = sm.resolve_backend(backend_spec(backend), dtype=x.dtype, d=d, n=n)   # as the layer does
  plan = jax.jit(lambda x, wr: sm.route(sm.router_logits(x, wr), k=K, rounding=rounding,
                                        tile=128, align=ops.align)[0])(x, wr)
  h = jax.jit(lambda *a: ops.up_proj(*a, plan))(x, w1)[0]
  rec = dict(config=name, backend=backend, rounding=rounding, windows=windows)
  rec["finite"] = bool(all(np.isfinite(np.asarray(a, np.float32)).all() for a in (out, dx, dwr, dw1, dw2)))
  rec["padding_rows_zero"] = bool(np.all(np.asarray(h, np.float32)[~np.asarray(plan.valid)] == 0))

  tok = np.asarray(plan.token_index)
  exp = np.asarray(plan.expert_index)
  valid = np.asarray(plan.valid)
  rng = np.random.default_rng(0)
  sample = rng.choice(T, num_tokens, replace=False)
  per_token = [exp[valid & (tok == t)] for t in sample]
  width = max(len(e) for e in per_token)
  experts = np.zeros((num_tokens, width), np.int32)
  mask = np.zeros((num_tokens, width), bool)
  for i, e in enumerate(per_token):
    experts[i, :len(e)], mask[i, :len(e)] = e, True
  o_ref, dx_ref = token_references(x[sample], dout[sample], wr, w1, w2, experts, mask, k=K)
  rec["out_rel_err_max"] = max(rel(out[t], o_ref[i]) for i, t in enumerate(sample))
  # with rounding the scores of added experts depend on the full plan: no per-token dX reference
  rec["dx_rel_err_max"] = (max(rel(dx[t], dx_ref[i]) for i, t in enumerate(sample))
                           if rounding is None else None)

  scores = np.asarray(plan.scores)
  errs_w = []
  counts = np.asarray(plan.group_sizes)
  for e in rng.choice(np.flatnonzero(counts > 0), num_experts, replace=False):
    rows = np.flatnonzero(valid & (exp == e))
    padded = np.full(-(-len(rows) // 128) * 128, T)      # a few shapes only: fewer compiles
    padded[:len(rows)] = tok[rows]
    keep = padded < T
    s = np.zeros(len(padded), np.float32)
    s[:len(rows)] = scores[rows]
    xe = jnp.where(keep[:, None], x[np.minimum(padded, T - 1)].astype(F32), 0.0)
    doe = jnp.where(keep[:, None], dout[np.minimum(padded, T - 1)].astype(F32), 0.0)
    ref1, ref2 = expert_weight_grads(xe, doe, jnp.asarray(s)[:, None], w1[e], w2[e])
    errs_w.append(max(rel(dw1[e], ref1), rel(dw2[e], ref2)))
  rec["dw_rel_err_max"] = max(errs_w)
  tol = 2e-2
  rec["ok"] = bool(rec["finite"] and rec["padding_rows_zero"] and rec["out_rel_err_max"] < tol
                   and (rec["dx_rel_err_max"] or 0) < tol and rec["dw_rel_err_max"] < tol)
  return rec


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--backend", default="pallas",
                 help='a backend, or a per-op mix such as "dh=cute+dx_tilde=cute"')
  p.add_argument("--configs", default=",".join(C.ANCHORS))
  p.add_argument("--windows", type=int, default=None,
                 help="the layer's column windows (moe's windows; default: the layer's default)")
  p.add_argument("--out", default=None, help="folder to write check_anchors.json into (default: none written)")
  a = p.parse_args(argv)
  recs = []
  for name in a.configs.split(","):
    for rounding in (None, "nearest"):
      try:
        rec = check(name, C.ANCHORS[name], a.backend, rounding, windows=a.windows)
      except Exception as e:
        rec = dict(config=name, backend=a.backend, rounding=rounding, ok=False,
                   error=f"{type(e).__name__}: {str(e)[:300]}")
      recs.append(rec)
      print(json.dumps(rec), flush=True)
      if a.out:  # after every case: a call cut short keeps what it measured
        output.write_json(a.out, "check_anchors", recs, quiet=True)
  if a.out:
    print(f"wrote {output.json_path(a.out, 'check_anchors')}")
  return recs


if __name__ == "__main__":
  main()
