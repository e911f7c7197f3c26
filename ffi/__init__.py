"""Backend "cute": CuTe DSL kernels called from XLA programs through XLA FFI custom calls
(`cutlass.jax.cutlass_call`). Needs the optional extra: pip install 'sonicmoe-jax[cute]'."""
