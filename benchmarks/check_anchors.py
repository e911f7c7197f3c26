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
import json

import jax
import jax.numpy as jnp
import numpy as np

import sonicmoe_jax as sm
from benchmarks import configs as C
from benchmarks.bench import make_args

F32 = jnp.float32


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def token_output(x_t, wr, w1, w2, experts, k):
  """O_t for one token over its fixed expert set (float32), scores as softmax over top-k."""
  logits = x_t.astype(F32) @ wr.astype(F32)
  sel = logits[experts]
  s = jnp.exp(sel - jax.nn.logsumexp(jax.lax.top_k(logits, k)[0]))
  n = w2.shape[1]
  h = jnp.einsum("d,kdf->kf", x_t.astype(F32), w1[experts].astype(F32))
  a = jax.nn.silu(h[:, :n]) * h[:, n:]
  return jnp.einsum("k,kn,knd->d", s, a, w2[experts].astype(F32))


def check(name, cfg, backend, rounding, num_tokens=16, num_experts=2):
  T, d, n, E, K = cfg
  (x, wr, w1, w2), dout = make_args(T, d, n, E, K)
  kw = dict(k=K, rounding=rounding, tile=128, backend=backend)

  @jax.jit
  def fwd_bwd(x, wr, w1, w2):
    res, vjp = jax.vjp(lambda *a: sm.moe(*a, **kw).out, x, wr, w1, w2)
    return res, vjp(dout)
  out, (dx, dwr, dw1, dw2) = fwd_bwd(x, wr, w1, w2)
  res = sm.moe(x, wr, w1, w2, **kw)
  plan = res.plan
  h = jax.jit(lambda *a: sm.resolve_backend(backend).up_proj(*a, plan))(x, w1)[0]
  rec = dict(config=name, backend=backend, rounding=rounding)
  rec["finite"] = bool(all(np.isfinite(np.asarray(a, np.float32)).all() for a in (out, dx, dwr, dw1, dw2)))
  rec["padding_rows_zero"] = bool(np.all(np.asarray(h, np.float32)[~np.asarray(plan.valid)] == 0))

  tok = np.asarray(plan.token_index)
  exp = np.asarray(plan.expert_index)
  valid = np.asarray(plan.valid)
  rng = np.random.default_rng(0)
  errs_o, errs_dx = [], []
  for t in rng.choice(T, num_tokens, replace=False):
    experts = jnp.asarray(exp[valid & (tok == t)])
    f = lambda xt: token_output(xt, wr, w1, w2, experts, K)
    o_ref, vjp = jax.vjp(f, x[t].astype(F32))
    errs_o.append(rel(out[t], o_ref))
    if rounding is None:  # with rounding the scores of added experts depend on the full plan
      errs_dx.append(rel(dx[t], vjp(dout[t].astype(F32))[0]))
  rec["out_rel_err_max"] = max(errs_o)
  rec["dx_rel_err_max"] = max(errs_dx) if errs_dx else None

  scores = np.asarray(plan.scores)
  errs_w = []
  counts = np.asarray(plan.group_sizes)
  for e in rng.choice(np.flatnonzero(counts > 0), num_experts, replace=False):
    rows = np.flatnonzero(valid & (exp == e))
    xe, doe = x[tok[rows]].astype(F32), dout[tok[rows]].astype(F32)
    s = jnp.asarray(scores[rows])[:, None]
    he = xe @ w1[e].astype(F32)
    g, u = he[:, :n], he[:, n:]
    dap = doe @ w2[e].astype(F32).T
    sig = jax.nn.sigmoid(g)
    da = s * dap
    dh = jnp.concatenate([da * u * sig * (1 + g * (1 - sig)), da * g * sig], axis=1)
    errs_w.append(max(rel(dw1[e], xe.T @ dh), rel(dw2[e], (s * jax.nn.silu(g) * u).T @ doe)))
  rec["dw_rel_err_max"] = max(errs_w)
  tol = 2e-2
  rec["ok"] = bool(rec["finite"] and rec["padding_rows_zero"] and rec["out_rel_err_max"] < tol
                   and (rec["dx_rel_err_max"] or 0) < tol and rec["dw_rel_err_max"] < tol)
  return rec


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--backend", default="pallas")
  p.add_argument("--configs", default=",".join(C.ANCHORS))
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  recs = []
  for name in a.configs.split(","):
    for rounding in (None, "nearest"):
      try:
        rec = check(name, C.ANCHORS[name], a.backend, rounding)
      except Exception as e:
        rec = dict(config=name, backend=a.backend, rounding=rounding, ok=False,
                   error=f"{type(e).__name__}: {str(e)[:300]}")
      recs.append(rec)
      print(json.dumps(rec), flush=True)
  if a.out:
    with open(a.out, "w") as f:
      json.dump(recs, f, indent=1)
  return recs


if __name__ == "__main__":
  main()
