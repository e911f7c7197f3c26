"""The ground every backend and the public API stand on: the routing plan (routing.py,
token_rounding.py), the reference math of the expert ops, which is also the xla backend
(xla_ops.py, swiglu.py; its GPU grouped GEMMs: tiled_grouped.py), the kernels' tile tables over
a plan (schedule.py), the zero-padding of widths up to the kernels' tiles (padding.py) and
argument checks (validation.py). Nothing here imports the API (sonicmoe_jax's other modules)
or a GPU backend (pallas_kernels, ffi): data flows down, from the API through the backends to
here.
"""
