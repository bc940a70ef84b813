"""The package's import graph: layers that import only downward, no cycles, and (almost) no imports
inside function bodies. Parses every module with ``ast`` (no import, no process group), so it runs
in well under a second. docs/architecture.md draws the layers."""

from __future__ import annotations

import ast
import subprocess
import sys
import pathlib
from collections import defaultdict

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "megatron_ext"

# Bottom to top. A module belongs to the layer of the longest name below that prefixes it; it may
# import modules of its own layer or of the layers under it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "base: process groups, C++ ops, configs",
        (
            "megatron_ext._C",
            "megatron_ext._ops",
            "megatron_ext._torch_compat",
            "megatron_ext.comm_errors",
            "megatron_ext.fusions",
            "megatron_ext.hyper_comm_grid",
            "megatron_ext.model_parallel_config",
            "megatron_ext.packed_seq_params",
            "megatron_ext.optimizer_param_scheduler",
            "megatron_ext.parallel_state",
            "megatron_ext.process_group_layout",
            "megatron_ext.global_memory_buffer",
            "megatron_ext.split_backward",
        ),
    ),
    ("which group, which model", ("megatron_ext.resolve", "megatron_ext.process_groups_config")),
    ("dist_checkpointing: a leaf that knows no model",
     ("megatron_ext.dist_checkpointing", "megatron_ext.utils")),
    ("tensor_parallel, and the datasets beside it (they know no model)",
     ("megatron_ext.tensor_parallel", "megatron_ext.mpu", "megatron_ext.datasets")),
    ("pipeline_parallel", ("megatron_ext.pipeline_parallel",)),
    ("distributed", ("megatron_ext.distributed",)),
    ("optimizer", ("megatron_ext.optimizer",)),
    ("transformer", ("megatron_ext.transformer", "megatron_ext.ssm")),
    ("models", ("megatron_ext.models",)),
    ("training", ("megatron_ext.training",)),
    ("the package's front door", ("megatron_ext",)),
]

# (importing module, imported module) -> why this import sits inside a function body. Each is exempt
# from the layer rule, not from the cycle check.
IN_FUNCTION_ALLOWED: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, pathlib.Path]:
    out = {"megatron_ext._C": PACKAGE / "_C"}  # the compiled extension: imports nothing of ours
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> list[tuple[str, bool, int]]:
    """(imported module of the package, inside a function body?, line) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    in_function = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for node in ast.walk(fn)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from pkg import sub` imports the submodule; `from mod import name` the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            if target == "megatron_ext" or target.startswith("megatron_ext."):
                while target not in modules:  # `import megatron_ext.x.y` of a name inside x
                    target = target.rpartition(".")[0]
                out.append((target, id(node) in in_function, node.lineno))
    return out


def _layer(name: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{name} is in no layer: add it to LAYERS in {__file__}"
    return best


def _graph() -> dict[str, list[tuple[str, bool, int]]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items() if path.suffix == ".py"}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    for name in _modules():
        _layer(name)


def test_no_import_cycles():
    edges: dict[str, set[str]] = defaultdict(set)
    for name, imports in _graph().items():
        edges[name].update(target for target, _, _ in imports)
    assert _cycles(edges) == []


def test_imports_point_down():
    upward = []
    for name, imports in _graph().items():
        for target, in_function, line in imports:
            if in_function and (name, target) in IN_FUNCTION_ALLOWED:
                continue
            if _layer(target) > _layer(name):
                layers = f"{LAYERS[_layer(name)][0]} -> {LAYERS[_layer(target)][0]}"
                upward.append(f"{name}:{line} imports {target} ({layers})")
    assert upward == []


def test_in_function_imports_are_the_allowed_few():
    found = {
        (name, target): line
        for name, imports in _graph().items()
        for target, in_function, line in imports
        if in_function
    }
    assert sorted(found) == sorted(IN_FUNCTION_ALLOWED)
    assert len(IN_FUNCTION_ALLOWED) <= 5


def test_the_checker_sees_what_it_checks(tmp_path):
    # the graph holds edges known to exist; an import inside a function is seen as one
    graph = _graph()
    layers = {(t, f) for t, f, _ in graph["megatron_ext.tensor_parallel.layers"]}
    assert ("megatron_ext.parallel_state", False) in layers
    model = {(t, f) for t, f, _ in graph["megatron_ext.models.gpt"]}
    assert ("megatron_ext.transformer.rotary", False) in model
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from megatron_ext.training import checkpointing\n")
    assert ("megatron_ext.training.checkpointing", True) in {
        (t, f) for t, f, _ in _imports("megatron_ext.dist_checkpointing.lazy", module, _modules())
    }
    # a cycle and a self-import are found
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}}) == [["a"]]
    assert _layer("megatron_ext.training.convert") > _layer("megatron_ext.optimizer.optimizer")


def test_dist_checkpointing_names_nothing_above_it():
    # A leaf: no module of dist_checkpointing imports a module of a higher floor, by statement or by
    # name (importlib, __import__, runpy); the one exception is the earlier converter command, which
    # runs the training level's converter by name only when started as a program.
    floor = _layer("megatron_ext.dist_checkpointing")
    by_name = set()
    for name, path in _modules().items():
        if not name.startswith("megatron_ext.dist_checkpointing"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            func = node.func if isinstance(node, ast.Call) else None
            called = getattr(func, "attr", getattr(func, "id", None))
            named = node.args[0] if func is not None and node.args else None
            if called in ("import_module", "__import__", "run_module") and isinstance(named, ast.Constant):
                target = node.args[0].value
                if _layer(target) > floor:
                    by_name.add((name, target))
    assert by_name == {("megatron_ext.dist_checkpointing.convert", "megatron_ext.training.convert")}
    stub = ast.parse(_modules()["megatron_ext.dist_checkpointing.convert"].read_text())
    guarded = stub.body[-1]
    assert isinstance(guarded, ast.If) and ast.unparse(guarded.test) == "__name__ == '__main__'"
    assert not any("training" in ast.unparse(node) for node in stub.body[1:-1])  # after the docstring


def test_no_module_over_700_lines():
    long = {name: n for name, path in _modules().items() if path.suffix == ".py"
            and (n := len(path.read_text().splitlines())) > 700}
    assert long == {}


CSRC = PACKAGE.parent / "csrc"


def _includes(path: pathlib.Path) -> list[str]:
    return [line.split('"')[1] for line in path.read_text().splitlines() if line.startswith('#include "')]


def test_cpp_kernels_include_no_op_or_comm_headers():
    # kernels/ is the framework-free math and its ATen-side checks; ops/ (the autograd glue) and
    # comm/ (c10d) build on it, never the reverse
    upward = {
        str(path.relative_to(CSRC)): include
        for path in CSRC.joinpath("kernels").rglob("*")
        if path.suffix in (".h", ".cpp", ".cu")
        for include in _includes(path)
        if include.startswith(("ops/", "comm/"))
    }
    assert upward == {}


def test_cpp_every_schema_in_registration():
    # one style of schema declaration: every m.def in registration.cpp's TORCH_LIBRARY block
    elsewhere = [
        str(path.relative_to(CSRC))
        for path in CSRC.rglob("*")
        if path.suffix in (".h", ".cpp", ".cu")
        and path.name != "registration.cpp"
        and ("TORCH_LIBRARY_FRAGMENT" in path.read_text() or "m.def(" in path.read_text())
    ]
    assert elsewhere == []
    assert "TORCH_LIBRARY(megatron_ext, m)" in CSRC.joinpath("registration.cpp").read_text()


def test_the_library_imports_no_peer():
    # Megatron-core and the Hugging Face packages are peers the compatibility tests compare
    # against (installed beside megatron_ext by ./dev.sh): importing every module of the package
    # loads none of them.
    code = (
        "import importlib, sys\n"
        f"for name in {sorted(n for n in _modules() if n != 'megatron_ext._C')!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'transformers', 'tokenizers', "
        "'einops', 'huggingface_hub', 'transformer_engine', 'apex'}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          cwd=PACKAGE.parent, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
