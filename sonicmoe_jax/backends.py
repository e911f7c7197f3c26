"""The one dispatch table: which implementation runs each expert op.

Ops (signatures as in xla_ops.py):
  top_k(logits, k) -> (values, experts)   router top-K over fp32 logits [T, E], as jax.lax.top_k
  rounded_slots(values, counts, offsets, num_slots) -> token_index
                                          token rounding's selection placed in the plan's slots:
                                          each column's counts[e] largest values (ties to the
                                          lower row) as their rows, from slot offsets[e] on
  up_proj(x, w1, plan) -> (H, A)          gather-fused varlen-M GEMM + SwiGLU
  down_proj(a, w2, plan, cols=None) -> Y  varlen-M GEMM, contiguous store
  aggregate(y, scores|None, plan, into=None) -> O
                                          per-token gather-and-sum; into=(out, lo): as columns
                                          lo .. of a wider result (out: its width or an
                                          earlier window's result), returned whole
  dh(dO, w2, H, scores, plan) -> (dH, dS, A')
  dx_tilde(dH, w1, plan, cols=None) -> dX~  varlen-M GEMM with W1^T
  dw1(x, dH, plan) -> dW1                 varlen-K GEMM, X rows gathered
  dw2(A', dO, plan) -> dW2                varlen-K GEMM, dO rows gathered

cols=(lo, hi) (the layer's `windows`, layer.column_windows): down_proj and dx_tilde make only
the product's columns lo .. hi - 1.

A backend is a module exposing OPS: {op name: function}, imported on first use, and optionally
ALIGN: the row alignment its kernels need for each expert's group of slots (the routing plan
is built with the largest ALIGN among the chosen backends), WIDTH_MULTIPLES: (d's, n's) the
multiples of the model and expert widths its expert ops tile by (the layer zero-pads widths
that are not up to the largest among the chosen backends: core/padding.py; absent: any width)
and AGGREGATE_INTO: True where its aggregate writes a column window into the result in place
(the layer's windows then chain through it instead of concatenating their sums). Every backend
implements every op. Users pick a backend by name for all ops ("xla", "pallas", "cute"), "auto" for the
platform default, or a mapping {op: backend} for a mix (ops left out use "auto").

"auto" picks the platform default (PLATFORM_DEFAULTS, from measurements: the pallas kernels
on GPUs), except that on GPUs the GEMM ops (and the router's top-K over many experts) run on
"cute" at the layer shapes where it measured faster (GPU_CUTE_WHERE) when the optional cute
extra is installed. When the
default backend's `unsupported(dtype, d, n)` names a reason (for example float32 inputs for
pallas), "auto" falls back to "xla" and says so with one warning naming the ops; a backend
asked for by name raises instead. `Ops.backend_by_op()` tells which backend each op got.

Kernel choices are data: a backend with choices exposes CONFIG_TYPE (ffi.config.CuteConfig,
pallas_kernels.config.PallasConfig: frozen, hashable), its ops take one as `config` (the
measured defaults unless given), and `resolve(..., kernel_config={backend name: config})`
binds it to that backend's ops (Configured), so a jitted layer sees it as static data.
"""
from __future__ import annotations

import importlib
import importlib.util
import warnings
from collections.abc import Mapping
import dataclasses
from typing import Callable, Hashable, NamedTuple, Optional, Union

import jax

from sonicmoe_jax.core import padding

OP_NAMES = ("top_k", "rounded_slots", "up_proj", "down_proj", "aggregate", "dh", "dx_tilde", "dw1", "dw2")
# the ops of the expert computation (the rest are the router's): the ones that see d and n
EXPERT_OPS = OP_NAMES[2:]

BACKEND_MODULES = {
    "xla": "sonicmoe_jax.core.xla_ops",
    "pallas": "pallas_kernels.ops",
    "cute": "ffi.ops",
}

# Default backend per op for each platform; a platform missing here uses "xla" everywhere.
# GPU: pallas for every op but the aggregation (the kernels; xla's tiled GEMMs are the
# portable reference).
PLATFORM_DEFAULTS: dict[str, dict[str, str]] = {
    "gpu": {op: "pallas" for op in ("top_k", "up_proj", "down_proj", "dh", "dx_tilde", "dw1", "dw2")},
}

class LayerShape(NamedTuple):
  """What "auto" chooses by on GPUs: the hidden size d, the expert width n, for the router's
  top-K the number of experts and k (None where the caller does not say), and whether the
  plan varies its slots per token (token rounding)."""
  d: int
  n: int
  num_experts: int | None = None
  k: int | None = None
  token_rounding: bool = False


def _everywhere(shape: LayerShape) -> bool:
  return True


def _many_experts(shape: LayerShape) -> bool:
  return None not in (shape.num_experts, shape.k) and shape.num_experts >= 256


def _token_rounding(shape: LayerShape) -> bool:
  return shape.token_rounding


# GPU ops the cute backend takes over, and where (by the LayerShape): every GEMM wherever the
# cute kernels can run the layer (each measured faster than its Pallas counterpart, alone and
# in the layer's step, at the paper's configs), the router's top-K where E >= 256 (one warp
# per token; at E = 128 the Pallas top-K is faster) and token rounding's selection (one CTA per
# expert; XLA's takes 32 passes over [T, E]) and, under token rounding, the aggregation (its
# tokens' slot counts vary: the kernel reads each token's own; XLA's reads blocks of k slots per
# token, as many as the busiest token needs, and for plain top-K fuses its sums into the
# windows' concatenation). docs/design.md, sections 3-4.
GPU_CUTE_WHERE = {"top_k": _many_experts, "rounded_slots": _everywhere,
                  "aggregate": _token_rounding, "up_proj": _everywhere, "down_proj": _everywhere,
                  "dh": _everywhere, "dx_tilde": _everywhere, "dw1": _everywhere,
                  "dw2": _everywhere}


def _unsupported_at_kernel_widths(module, dtype, d: int | None, n: int | None):
  """module.unsupported at the widths the layer pads d and n to for it (its WIDTH_MULTIPLES)."""
  multiples = getattr(module, "WIDTH_MULTIPLES", (1, 1))
  pad = lambda width, multiple: None if width is None else padding.padded_width(width, multiple)
  return module.unsupported(dtype, pad(d, multiples[0]), pad(n, multiples[1]))


# The layer's column windows when moe's `windows` is left None: WINDOWED_STORE_WINDOWS where
# the store GEMMs (down_proj, dx_tilde) run on cute and Y's rows are at least as wide as H's
# (d >= 2n), else 1. Two windows hold the step's peak to half of the [slots, d] product, for one
# more read of the GEMM's left operand per window; where d < 2n the peak is not that product.
WINDOWED_STORE_WINDOWS = 2


def default_windows(store_backends: tuple[str, str], d: int | None, n: int | None) -> int:
  """The column windows moe makes by default: store_backends are down_proj's and dx_tilde's."""
  if store_backends == ("cute", "cute") and None not in (d, n) and d >= 2 * n:
    return WINDOWED_STORE_WINDOWS
  return 1


@dataclasses.dataclass(frozen=True)
class Configured:
  """A backend op with its kernel configuration bound: called as the op, it passes
  `config=config`. Hashable by value (the op's function and a frozen config), so Ops holding it
  stays a valid static argument and jit caches one program per configuration."""
  fn: Callable
  config: Hashable

  def __call__(self, *args, **kwargs):
    return self.fn(*args, config=self.config, **kwargs)


def cute_installed() -> bool:
  """Whether the cute extra (CuTe DSL and jax-tvm-ffi) is installed."""
  return all(importlib.util.find_spec(m) is not None for m in ("cutlass", "jax_tvm_ffi"))


BackendSpec = Union[str, Mapping[str, str]]


class Ops(NamedTuple):
  """Resolved implementations, one per op, and the plan alignment they need (hashable: used
  as a static argument)."""
  top_k: Callable
  rounded_slots: Callable
  up_proj: Callable
  down_proj: Callable
  aggregate: Callable
  dh: Callable
  dx_tilde: Callable
  dw1: Callable
  dw2: Callable
  align: int = 1
  width_multiples: tuple[int, int] = (1, 1)   # (d's, n's): the expert ops' WIDTH_MULTIPLES
  windows: int = 1   # the layer's default column windows (default_windows)
  aggregate_into: bool = False   # aggregate writes windows into the result (AGGREGATE_INTO)
  backends: tuple[str, ...] = ()   # the backend each op runs on, in OP_NAMES order

  def backend_by_op(self) -> dict[str, str]:
    """{op name: the backend it runs on}, as resolve chose them."""
    return dict(zip(OP_NAMES, self.backends))

  def kernel_widths(self, d: int, n: int) -> tuple[int, int]:
    """The widths (d', n') the expert ops run a layer of widths (d, n) at: each rounded up to
    its multiple in width_multiples (the layer zero-pads to them: core/padding.py)."""
    return (padding.padded_width(d, self.width_multiples[0]),
            padding.padded_width(n, self.width_multiples[1]))


def _backend_module(name: str):
  if name not in BACKEND_MODULES:
    known = ", ".join(map(repr, (*BACKEND_MODULES, "auto")))
    raise ValueError(f"backend must be one of {known} or a mapping of op name to backend; got {name!r}")
  try:
    module = importlib.import_module(BACKEND_MODULES[name])
  except ImportError as e:
    raise ImportError(f"backend {name!r} is not available here: {e}") from e
  return module


def _check_kernel_config(kernel_config) -> dict:
  """kernel_config as a dict, each entry checked against its backend's CONFIG_TYPE."""
  if kernel_config is None:
    return {}
  if not isinstance(kernel_config, Mapping):
    raise TypeError(f"kernel_config must be a mapping of backend name to its configuration; got "
                    f"{type(kernel_config).__name__}")
  for name, config in kernel_config.items():
    module = _backend_module(name)
    config_type = getattr(module, "CONFIG_TYPE", None)
    if config_type is None:
      raise ValueError(f"kernel_config: backend {name!r} has no kernel choices to configure")
    if not isinstance(config, config_type):
      raise TypeError(f"kernel_config[{name!r}] must be a {config_type.__module__}."
                      f"{config_type.__name__}; got {type(config).__name__}")
  return dict(kernel_config)


def default_backend(op: str, platform: str | None = None, *, dtype=None, d: int | None = None,
                    n: int | None = None, num_experts: int | None = None,
                    k: int | None = None, token_rounding: bool = False) -> str:
  """The backend "auto" picks for op: PLATFORM_DEFAULTS, or on GPUs "cute" for the ops of
  GPU_CUTE_WHERE at the shapes it names, where the cute extra is installed and can run the
  layer (and, for top_k, these logits)."""
  platform = platform or jax.default_backend()
  if (platform == "gpu" and op in GPU_CUTE_WHERE and None not in (dtype, d, n)
      and GPU_CUTE_WHERE[op](LayerShape(d, n, num_experts, k, token_rounding))
      and cute_installed()):
    cute = _backend_module("cute")
    if (_unsupported_at_kernel_widths(cute, dtype, d, n) is None
        and (op != "top_k" or cute.top_k_unsupported(num_experts, k) is None)):
      return "cute"
  return PLATFORM_DEFAULTS.get(platform, {}).get(op, "xla")


def resolve(backend: BackendSpec = "auto", platform: str | None = None, *, dtype=None,
            d: int | None = None, n: int | None = None, num_experts: int | None = None,
            k: int | None = None, token_rounding: bool = False,
            kernel_config: Optional[Mapping[str, Hashable]] = None) -> Ops:
  """Resolves a backend spec to one implementation per op.

  dtype, d, n (the layer's input dtype and widths) let "auto" skip a default backend that
  cannot run them; num_experts and k (the router's) let it pick the top-K's; token_rounding
  (the plan varies its slots per token) the aggregation's.
  kernel_config: {backend name: its configuration} (an instance of the backend's CONFIG_TYPE)
  for the ops that run on that backend; backends left out run their defaults.

  Raises ValueError for an unknown backend or op name, ImportError when a backend's
  dependencies are missing, TypeError for a kernel_config of the wrong type.
  """
  configs = _check_kernel_config(kernel_config)
  if isinstance(backend, str):
    choice = {op: backend for op in OP_NAMES}
  elif isinstance(backend, Mapping):
    unknown = set(backend) - set(OP_NAMES)
    if unknown:
      raise ValueError(f"backend mapping has unknown op names {sorted(unknown)}; ops are {OP_NAMES}")
    choice = {op: backend.get(op, "auto") for op in OP_NAMES}
  else:
    raise TypeError(f"backend must be a string or a mapping of op name to backend; got {type(backend).__name__}")
  impls, names, align, multiples = {}, {}, 1, (1, 1)
  fallbacks = {}   # (default backend, reason) -> the ops "auto" moved to xla for it
  for op, name in choice.items():
    if name == "auto":
      name = default_backend(op, platform, dtype=dtype, d=d, n=n, num_experts=num_experts, k=k,
                             token_rounding=token_rounding)
      module = _backend_module(name)
      reason = (_unsupported_at_kernel_widths(module, dtype, d, n)
                if hasattr(module, "unsupported") and dtype is not None else None)
      if reason:
        fallbacks.setdefault((name, reason), []).append(op)
        name = "xla"
    module = _backend_module(name)
    impls[op], names[op] = module.OPS[op], name
    if name in configs:
      impls[op] = Configured(module.OPS[op], configs[name])
    align = max(align, getattr(module, "ALIGN", 1))
    if op in EXPERT_OPS:
      multiples = tuple(map(max, multiples, getattr(module, "WIDTH_MULTIPLES", (1, 1))))
  for (name, reason), ops in fallbacks.items():
    warnings.warn(f"backend 'auto': {name!r} cannot run this layer ({reason}); using 'xla' for "
                  f"{', '.join(ops)}", stacklevel=3)
  windows = default_windows((names["down_proj"], names["dx_tilde"]), d, n)
  aggregate_into = getattr(_backend_module(names["aggregate"]), "AGGREGATE_INTO", False)
  return Ops(**impls, align=align, width_multiples=multiples, windows=windows,
             aggregate_into=aggregate_into, backends=tuple(names[op] for op in OP_NAMES))
