"""Runs the multi-device suite (tests/multidevice) in its own process on 8 virtual CPU devices."""
import os
import subprocess
import sys

HERE = os.path.dirname(__file__)


def test_multidevice_suite():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  files = sorted(os.path.join(HERE, "multidevice", f) for f in os.listdir(os.path.join(HERE, "multidevice"))
                 if f.startswith("check_") and f.endswith(".py"))
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "--rootdir", HERE, *files], env=env, capture_output=True, text=True,
                        cwd=os.path.dirname(HERE))
  print(proc.stdout[-5000:], proc.stderr[-3000:])
  assert proc.returncode == 0, proc.stdout[-5000:]
