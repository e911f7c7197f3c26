"""Benchmark configurations (T, d, n, E, K): the SonicMoE paper's five layers, layers of released
models at T = 32768, and FLOP formulas."""
ANCHORS = {
    "7B-n256": (24576, 1536, 256, 128, 8),
    "7B-n1024": (24576, 1536, 1024, 32, 2),
    "30B-n256": (32768, 4096, 256, 256, 16),
    "120B-n1024": (32768, 4096, 1024, 128, 8),
    "olmoe": (32768, 2048, 1024, 64, 8),
}
# MoE layers of released models (d, expert width n, E, K) at T = 32768 tokens
PRODUCTION = {
    "qwen3-30b-a3b": (32768, 2048, 768, 128, 8),
    "mixtral-8x7b": (32768, 4096, 14336, 8, 2),
    "dbrx": (32768, 6144, 10752, 16, 4),
    "gpt-oss-20b": (32768, 2880, 2880, 32, 4),     # d, n multiples of 64, not of 128
    "gpt-oss-120b": (32768, 2880, 2880, 128, 4),
}
TINY = {"tiny": (256, 256, 32, 8, 2)}   # d 256: two column windows fit
NAMED = {**ANCHORS, **PRODUCTION, **TINY}


def fwd_flops(T, d, n, E, K):
  """Model FLOPs of the forward: up-projection 4TKdn + down-projection 2TKnd."""
  return 6 * T * n * K * d


def fwd_bwd_flops(T, d, n, E, K):
  return 18 * T * n * K * d


def lookup(text: str):
  """A named config (NAMED) or 'T,d,n,E,K' -> (name, (T, d, n, E, K))."""
  if text in NAMED:
    return text, NAMED[text]
  if "," not in text:
    raise ValueError(f"unknown config {text!r}: name one of {', '.join(NAMED)} or give T,d,n,E,K")
  return parse_config(text)


def parse_config(text: str):
  """'T,d,n,E,K' -> (name, (T, d, n, E, K))."""
  vals = tuple(int(v) for v in text.split(","))
  if len(vals) != 5:
    raise ValueError(f"a config is T,d,n,E,K; got {text!r}")
  return "T{}-d{}-n{}-E{}-K{}".format(*vals), vals
