"""The package's layering (docs/architecture.md), checked on the source.

Every `import` of every module counts, including imports inside functions:
a lazy import is still a dependency. The rules:

* each component imports only the components below it (`ALLOWED`);
* the import graph between modules has no cycle;
* no module imports a private name (`_x`) of another module, and the tests,
  examples and benchmarks use public names only.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "keras_softmax_heads"

#: Component -> the components it may import (besides itself). A component
#: is a top-level module or sub-package of `keras_softmax_heads`.
NUMERICS = {"validation", "platforms", "functional", "chunked", "samplers", "clustering"}
ALLOWED = {
    "validation": set(),
    "version": set(),
    "platforms": {"validation"},
    "functional": {"validation", "platforms"},
    "chunked": {"validation", "platforms", "functional"},
    "samplers": {"validation"},
    "clustering": {"validation"},
    "heads": NUMERICS,
    "head_model": NUMERICS | {"heads"},
    "cloning": set(),
    "fused": NUMERICS,
    "losses": NUMERICS | {"heads", "fused"},
    "metrics": NUMERICS | {"heads", "fused", "losses"},
    "diagnostics": {"validation"},
    "models": {"validation"},
    "data": {"validation"},
    "experiments": NUMERICS | {"heads", "head_model", "fused", "losses", "metrics", "diagnostics",
                               "models", "data"},
    "training": NUMERICS | {"heads", "head_model", "fused", "losses", "metrics", "diagnostics",
                            "models", "data", "version"},
}


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _package_modules():
    return {
        _module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))
    }


MODULES = _package_modules()


def _resolve(name):
    """The package module that `import name` executes last (or None)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path, module):
    """`(target module, imported names)` for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, []))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                if not is_package:
                    anchor = anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [a.name for a in node.names]
            # `from pkg import submodule` imports the submodule.
            for name in names:
                if f"{base}.{name}" in MODULES:
                    found.append((f"{base}.{name}", []))
            plain = [n for n in names if f"{base}.{n}" not in MODULES]
            if plain:
                found.append((base, plain))
    return [(t, n) for t, n in found if t == PACKAGE or t.startswith(PACKAGE + ".")]


def _component(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _graph():
    graph = {}
    for module, path in MODULES.items():
        graph[module] = {
            _resolve(target) for target, _ in _imports(path, module)
        } - {None, module}
    return graph


def test_layering():
    violations = []
    for module, path in MODULES.items():
        source = _component(module)
        if source is None:  # the package's __init__ re-exports everything
            continue
        assert source in ALLOWED, f"{module}: component {source!r} has no rule in ALLOWED"
        for target, _ in _imports(path, module):
            target_component = _component(_resolve(target))
            if target_component is None:
                violations.append(f"{module} imports the top-level package")
            elif target_component != source and target_component not in ALLOWED[source]:
                violations.append(f"{module} ({source}) imports {target} ({target_component})")
    assert not violations, "\n".join(violations)


def test_import_graph_has_no_cycle():
    graph = _graph()
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _private_uses(path, module):
    """Private names of other package modules used by `path`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    module_aliases = {}
    for target, names in _imports(path, module):
        owner = _resolve(target)
        for name in names:
            if name.startswith("_") and owner != module:
                bad.append(f"from {target} import {name}")
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                full = alias.name if isinstance(node, ast.Import) else f"{node.module}.{alias.name}"
                if full in MODULES and full != module:
                    module_aliases[alias.asname or alias.name.split(".")[0]] = full
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in module_aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            bad.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
    return bad


@pytest.mark.parametrize("folder", [PACKAGE, "tests", "examples", "benchmarks"])
def test_no_private_names_across_modules(folder):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        module = _module_name(path) if folder == PACKAGE else None
        bad += [f"{path.relative_to(ROOT)}: {use}" for use in _private_uses(path, module)]
    assert not bad, "\n".join(bad)


def test_importing_the_package_does_not_import_tensorflow_datasets():
    import subprocess
    import sys

    code = (
        "import sys, keras_softmax_heads, keras_softmax_heads.data; "
        "print('tensorflow_datasets' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"TF_CPP_MIN_LOG_LEVEL": "3", **__import__("os").environ},
    )
    assert out.stdout.strip().splitlines()[-1] == "False"


#: Private Keras / TensorFlow APIs the package must not use (they break
#: without notice: TF Addons died partly of that).
PRIVATE_FRAMEWORK_APIS = (
    "keras.src", "tensorflow.python", "tf.python", "tf.compat.v1", "__internal__",
    "._flatten_layers", "._seed_generators", "._tracker", "._layers",
)


def test_public_framework_apis_only():
    bad = []
    for module, path in MODULES.items():
        text = path.read_text()
        bad += [f"{path.relative_to(ROOT)}: {api}" for api in PRIVATE_FRAMEWORK_APIS if api in text]
    assert not bad, "\n".join(bad)


def test_importing_the_package_on_jax_does_not_import_tensorflow():
    """On another backend the heads, losses, metrics and HeadModel load
    without TensorFlow (data/ and training/ import it when used)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("jax")
    code = (
        "import sys, keras_softmax_heads as ksh; ksh.FullSoftmax(5); "
        "print('tensorflow' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_every_module_states_its_job_and_is_in_the_architecture_page():
    """Each module has a docstring (its job in the first line) and
    docs/architecture.md names it, so a reader finds every module there."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    undocumented, unnamed = [], []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        if not (ast.get_docstring(tree) or "").strip():
            undocumented.append(module)
        if path.name == "__init__.py":
            continue
        if path.name not in page:
            unnamed.append(f"{path.relative_to(ROOT)}")
    assert not undocumented, "modules without a docstring: " + ", ".join(undocumented)
    assert not unnamed, "modules docs/architecture.md does not name: " + ", ".join(unnamed)


def test_tf_functions_without_autograph():
    """Every `tf.function` of the package and the tests is built with
    `autograph=False`, as Keras' trainer runs a model: the code is
    `keras.ops` without Python control flow on tensors, and AutoGraph's
    source conversion costs seconds of tracing per graph."""
    missing = []
    paths = list(MODULES.values()) + sorted((ROOT / "tests").glob("*.py"))
    for path in paths:
        nodes = list(ast.walk(ast.parse(path.read_text(), filename=str(path))))
        called = {id(n.func) for n in nodes if isinstance(n, ast.Call)}
        for node in nodes:
            if id(node) in called:
                continue  # its call is checked
            target = node.func if isinstance(node, ast.Call) else node
            if not (isinstance(target, ast.Attribute) and target.attr == "function"
                    and isinstance(target.value, ast.Name) and target.value.id == "tf"):
                continue
            keywords = node.keywords if isinstance(node, ast.Call) else []
            if not any(k.arg == "autograph" for k in keywords):
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not missing, "tf.function without autograph=False: " + ", ".join(sorted(set(missing)))
