"""Where the benchmark scripts write: `--out` is a folder everywhere (made if missing), each
script writing its JSON there under its own name and naming the file it wrote."""
from __future__ import annotations

import json
import os


def json_path(folder: str, name: str) -> str:
  """<folder>/<name>.json, the folder made if missing."""
  os.makedirs(folder, exist_ok=True)
  return os.path.join(folder, f"{name}.json")


def write_json(folder: str, name: str, records, lines: bool = False, quiet: bool = False) -> str:
  """Writes records to <folder>/<name>.json (one JSON value, or with lines one per line) and
  returns the path; unless quiet, prints 'wrote <path>'."""
  path = json_path(folder, name)
  with open(path, "w") as f:
    if lines:
      f.writelines(json.dumps(r) + "\n" for r in records)
    else:
      json.dump(records, f, indent=1)
  if not quiet:
    print(f"wrote {path}")
  return path
