"""BUILD describes the code: every import of a project package from a module is declared in
that module's target's deps, the targets' deps form no cycle, and the backends that
sonicmoe_jax/backends.py loads by name are declared deps of sonicmoe_jax."""
import ast
import pathlib
import re

from sonicmoe_jax import backends

ROOT = pathlib.Path(__file__).resolve().parent.parent
# a module's target by its path (the first prefix that matches)
TARGETS = (("sonicmoe_jax/core/", "core"), ("sonicmoe_jax/", "sonicmoe_jax"),
           ("pallas_kernels/", "pallas_kernels"), ("ffi/", "ffi"), ("models/", "models"),
           ("benchmarks/", "benchmarks"), ("examples/", "examples"))


def target_of_path(path: str):
  return next((target for prefix, target in TARGETS if path.startswith(prefix)), None)


def target_of_module(module: str):
  return target_of_path(module.replace(".", "/") + "/") if module else None


def declared_deps() -> dict:
  """{target: set of its deps} from BUILD's py_library rules."""
  text = (ROOT / "BUILD").read_text()
  deps = {}
  for rule in re.finditer(r"py_library\((.*?)\n\)", text, re.S):
    name = re.search(r'name = "(\w+)"', rule.group(1)).group(1)
    listed = re.search(r"deps = \[(.*?)\]", rule.group(1), re.S)
    deps[name] = set(re.findall(r'":(\w+)"', listed.group(1))) if listed else set()
  return deps


def imports_of(path: pathlib.Path):
  """The project modules path imports (absolute imports, at any depth of the file)."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      yield node.module
      yield from (f"{node.module}.{alias.name}" for alias in node.names)


def test_every_import_is_a_declared_dep():
  deps = declared_deps()
  missing = set()
  for path in ROOT.glob("*/**/*.py"):
    rel = path.relative_to(ROOT).as_posix()
    source = target_of_path(rel)
    if source is None or rel.startswith("benchmarks/results/"):
      continue
    for module in imports_of(path):
      target = target_of_module(module)
      if target and target != source and target not in deps[source]:
        missing.add((rel, module, target))
  assert not missing, sorted(missing)


def test_the_targets_form_no_cycle():
  deps = declared_deps()
  state = {}

  def visit(target, stack):
    if state.get(target) == "done":
      return
    assert state.get(target) != "open", f"cycle: {' -> '.join(stack + [target])}"
    state[target] = "open"
    for dep in deps[target]:
      visit(dep, stack + [target])
    state[target] = "done"

  for target in deps:
    visit(target, [])
  assert deps["core"] == set()   # the ground imports no other target


def test_backends_loaded_by_name_are_declared():
  deps = declared_deps()
  by_name = {target_of_module(module) for module in backends.BACKEND_MODULES.values()}
  assert by_name - {"sonicmoe_jax"} <= deps["sonicmoe_jax"]
  assert backends.BACKEND_MODULES["xla"].startswith("sonicmoe_jax.core.")
