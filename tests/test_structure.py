"""The code's shape: no import circles, short hot-path functions, algorithms that issue no collective.

These read the source (ast), so they fail when a change reintroduces a module that imports one
that imports it back (lazily or not), a step-path function past about 60 lines, or a collective
called from an algorithm module.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Modules on the step path: every function in them stays short enough to hold in mind.
HOT_PATH = ["hvd_zoadam/shell/optimizer.py", "hvd_zoadam/shell/driver.py", "hvd_zoadam/shell/horovod_contract.py",
            "hvd_zoadam/shell/torch_optim.py", "hvd_zoadam/shell/overlap.py", "hvd_zoadam/shell/options.py",
            "hvd_zoadam/shell/stats.py", "hvd_zoadam/shell/horovod.py",
            "hvd_zoadam/core/engine.py", "hvd_zoadam/core/step_math.py", "hvd_zoadam/core/schedule.py",
            "hvd_zoadam/core/layout.py", "hvd_zoadam/core/algorithms/__init__.py",
            "hvd_zoadam/core/algorithms/zeroone.py", "hvd_zoadam/core/algorithms/onebit.py",
            "hvd_zoadam/comm/protocol.py", "hvd_zoadam/comm/transport.py", "hvd_zoadam/comm/hierarchical.py",
            "hvd_zoadam/comm/horovod.py", "hvd_zoadam/comm/mpi.py", "hvd_zoadam/comm/thread.py",
            "native/__init__.py", "native/cpu.py", "native/reference.py"]
# The CUDA module's kernel factory holds several kernels, each short.
LONG_OK = {("native/cuda.py", "_make_kernels")}
# The layers (docs/architecture.md): none of these imports the shell or the benchmarks.
LOWER_LAYERS = ("hvd_zoadam.core", "hvd_zoadam.comm", "hvd_zoadam.native", "hvd_zoadam.oracle")
UPPER_LAYERS = ("hvd_zoadam.shell", "hvd_zoadam.bench")
MAX_CLASS_LINES = 300
MAX_LINES = 60


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if rel.parts[0] == "native":
        return "hvd_zoadam.native" + ("" if rel.name == "__init__.py" else "." + rel.stem)
    name = ".".join(rel.with_suffix("").parts)
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def _import_graph() -> dict:
    files = list((ROOT / "hvd_zoadam").rglob("*.py")) + list((ROOT / "native").glob("*.py"))
    mods = {_module_name(f): f for f in files}
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("hvd_zoadam"):
                    continue
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
                deps.update(subs if len(subs) == len(node.names) else [target, *subs])
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("hvd_zoadam"))
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def test_no_module_imports_one_that_imports_it_back():
    graph = _import_graph()
    assert "hvd_zoadam.shell.horovod" in graph and "hvd_zoadam.native.cpu" in graph
    circles = []
    for a, deps in graph.items():
        for b in deps:
            seen, stack = set(), [b]
            while stack:
                x = stack.pop()
                if x == a:
                    circles.append((a, b))
                    break
                if x not in seen:
                    seen.add(x)
                    stack.extend(graph.get(x, ()))
    assert not circles, f"import circles (module, import that leads back to it): {sorted(circles)}"


def _length(node) -> int:
    """A function's lines, its docstring left out (a docstring may document every option)."""
    first = node.body[0] if node.body else None
    doc = (first.end_lineno - first.lineno + 1 if isinstance(first, ast.Expr)
           and isinstance(getattr(first, "value", None), ast.Constant) and isinstance(first.value.value, str) else 0)
    return node.end_lineno - node.lineno + 1 - doc


@pytest.mark.parametrize("rel", HOT_PATH)
def test_step_path_functions_stay_short(rel):
    tree = ast.parse((ROOT / rel).read_text())
    long = [(node.name, _length(node)) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and _length(node) > MAX_LINES and (rel, node.name) not in LONG_OK]
    assert not long, f"{rel}: functions over {MAX_LINES} lines: {long}"


def test_no_function_anywhere_is_over_about_60_lines():
    """The step path's rule for the whole package, the benchmarks and the oracle included, but
    for the CUDA kernels' factory."""
    files = list((ROOT / "hvd_zoadam").rglob("*.py")) + list((ROOT / "native").glob("*.py"))
    long = [(str(f.relative_to(ROOT)), node.name, _length(node)) for f in files
            for node in ast.walk(ast.parse(f.read_text())) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and _length(node) > MAX_LINES and (str(f.relative_to(ROOT)), node.name) not in LONG_OK]
    assert not long, f"functions over {MAX_LINES} lines: {long}"


def test_a_transport_per_file():
    """comm/transport.py holds the base alone; each transport (with its own base, if any) is a
    module of its own, and the mpi4py transports do not derive from Horovod's but for the one
    that runs on Horovod's MPI world."""
    import importlib
    import inspect

    from hvd_zoadam.comm.transport import Transport
    homes = {}
    for path in (ROOT / "hvd_zoadam" / "comm").glob("*.py"):
        module = importlib.import_module(f"hvd_zoadam.comm.{path.stem}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, Transport) and cls.__module__ == module.__name__:
                homes[name] = path.stem
    assert homes == {"Transport": "transport", "HorovodTransport": "horovod", "MPIRounds": "mpi",
                     "MPITransport": "mpi", "MPICommTransport": "mpi", "GlooTransport": "gloo",
                     "TorchDistributedTransport": "torch_distributed", "ThreadTransport": "thread"}, homes
    from hvd_zoadam.comm.horovod import HorovodTransport
    from hvd_zoadam.comm.mpi import MPICommTransport
    assert not issubclass(MPICommTransport, HorovodTransport)


def test_each_bench_subcommand_is_a_module_that_registers_itself():
    import argparse

    from hvd_zoadam.bench import cli
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    for module in cli.COMMANDS:
        module.add_parser(sub)
    names = set(sub.choices)
    assert names == {"network", "step", "kernels", "model", "convergence", "scaling", "sweep", "resume", "load",
                     "chaos", "torchrun"}, names
    assert all(callable(p.get_default("run")) for p in sub.choices.values())
    assert len((ROOT / "hvd_zoadam" / "bench" / "cli.py").read_text().splitlines()) < 80


def test_the_algorithms_satisfy_the_contract():
    """Each algorithm module's class is an :class:`Algorithm` (0/1 Adam also the two optional
    contracts), with the contract's parameter names."""
    import inspect

    from hvd_zoadam.core.algorithms import Algorithm, CompressedGradients, EarlySync
    from hvd_zoadam.core.algorithms.onebit import OnebitAdam
    from hvd_zoadam.core.algorithms.zeroone import ZeroOneAdam
    from hvd_zoadam.core.schedule import Schedule
    zero, one = ZeroOneAdam(Schedule(5, 2, 3, 4)), OnebitAdam(Schedule(5, 1, 3, 4))

    def params(fn):
        return [p for p in inspect.signature(fn).parameters if p != "self"]
    for algo, contracts in ((zero, (Algorithm, CompressedGradients, EarlySync)), (one, (Algorithm,))):
        for contract in contracts:
            assert isinstance(algo, contract), (type(algo).__name__, contract.__name__)
            for name, fn in vars(contract).items():
                if callable(fn) and not name.startswith("_"):
                    assert params(getattr(type(algo), name)) == params(fn), (type(algo).__name__, name)


def test_the_knobs_are_documented_once():
    """Every knob of the three front ends has its one line in ``options.KNOB_DOCS``, rendered
    into each front end's docstring, whose source holds the ``{knobs}`` marker, not the text."""
    import inspect

    import hvd_zoadam
    import hvd_zoadam.distributed as zd
    import hvd_zoadam.mpi as zm
    from hvd_zoadam.shell.options import KNOB_DOCS
    horovods_own = {"optimizer", "named_parameters", "compression", "op", "gradient_predivide_factor",
                    "num_groups", "groups", "sparse_as_dense", "process_set"}
    for front_end in (hvd_zoadam.DistributedOptimizer, zd.DistributedOptimizer):
        knobs = {n for n, p in inspect.signature(front_end).parameters.items()
                 if p.default is not p.empty and n not in horovods_own | {"process_group"}}
        assert knobs == set(KNOB_DOCS), knobs ^ set(KNOB_DOCS)
    for front_end in (hvd_zoadam.DistributedOptimizer, zd.DistributedOptimizer, zm.DistributedOptimizer):
        doc = " ".join(front_end.__doc__.split())
        assert all(f"* ``{name}`` (default" in doc for name in KNOB_DOCS), front_end.__module__
        assert "{knobs}" in inspect.getsource(front_end)


def test_algorithms_issue_no_collective():
    """An algorithm receives the exchange as a callable: it names no transport and starts nothing."""
    paths = list((ROOT / "hvd_zoadam" / "core" / "algorithms").glob("*.py"))
    assert len(paths) >= 3
    for path in paths:
        tree = ast.parse(path.read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        comm = {m for m in imported if _in(m, ("hvd_zoadam.comm", "horovod", "mpi4py", "torch.distributed"))
                or m.split(".")[-1] in ("transport", "protocol")}
        assert not comm, (path.name, comm)
        calls = {node.func.attr for node in ast.walk(tree)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
        assert not calls & {"start", "wait", "allgather", "alltoall", "allreduce_average_", "start_scales",
                            "allgather_object"}, (path.name, calls)


def _in(name: str, layers) -> bool:
    return any(name == layer or name.startswith(layer + ".") for layer in layers)


def test_lower_layers_import_neither_the_shell_nor_the_benchmarks():
    """The engine, the algorithms, communication, the kernels and the oracle never import the
    shell (what users hold) or ``bench/``; nothing in the library imports ``bench/``."""
    graph = _import_graph()
    assert any(_in(m, ("hvd_zoadam.core",)) for m in graph) and any(_in(m, ("hvd_zoadam.comm",)) for m in graph)
    wrong = sorted((a, b) for a, deps in graph.items() for b in deps
                   if _in(a, LOWER_LAYERS) and _in(b, UPPER_LAYERS))
    assert not wrong, f"lower layers importing the shell or the benchmarks: {wrong}"
    into_bench = sorted((a, b) for a, deps in graph.items() for b in deps
                        if not _in(a, ("hvd_zoadam.bench",)) and _in(b, ("hvd_zoadam.bench",)))
    assert not into_bench, f"library modules importing the benchmarks: {into_bench}"


def test_no_class_is_over_about_300_lines():
    files = list((ROOT / "hvd_zoadam").rglob("*.py")) + list((ROOT / "native").glob("*.py"))
    big = [(str(f.relative_to(ROOT)), node.name, node.end_lineno - node.lineno + 1) for f in files
           for node in ast.walk(ast.parse(f.read_text())) if isinstance(node, ast.ClassDef)
           and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert not big, f"classes over {MAX_CLASS_LINES} lines: {big}"


# Top-level names of the GPU stack that a test package must not take: pytest puts tests/ on
# sys.path, so a package tests/cuda is imported as ``cuda`` and hides NVIDIA's cuda-bindings
# (``cuda.bindings``), which numba-cuda imports on a GPU (not under the simulator).
GPU_STACK_NAMES = {"cuda", "numba", "torch", "triton", "cupy", "nvidia", "mpi4py", "horovod"}


def test_no_test_package_shadows_a_gpu_stack_module():
    packages = {p.parent.name for p in (ROOT / "tests").glob("*/__init__.py")}
    assert packages, "tests/ should hold the GPU tests' package"
    assert not packages & GPU_STACK_NAMES, (
        f"test packages {sorted(packages & GPU_STACK_NAMES)} would shadow the modules of that name")


def test_every_public_function_annotates_its_parameters():
    """Every public function and method of the package and of ``native/`` (but the Numba
    kernels of ``native/cpu.py`` and ``native/cuda.py``, typed by the table of
    :mod:`hvd_zoadam.native`) annotates each of its parameters."""
    files = [f for f in list((ROOT / "hvd_zoadam").rglob("*.py")) + list((ROOT / "native").glob("*.py"))
             if f.name not in ("cpu.py", "cuda.py") or f.parent.name != "native"]
    missing = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    (not node.name.startswith("_") or node.name == "__init__"):
                a = node.args
                args = [x for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]
                        if x is not None and x.arg not in ("self", "cls")]
                missing += [f"{f.relative_to(ROOT)}:{node.lineno} {node.name}({x.arg})" for x in args
                            if x.annotation is None]
    assert not missing, missing[:20]


def test_the_readme_is_a_user_guide():
    """About 15 KB, at most three commit hashes, no table cell over 160 characters, an install
    command and the torchrun change within the first 120 lines (the rest lives in docs/)."""
    import re
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 15_500, len(text.encode())
    hashes = re.findall(r"\b[0-9a-f]{7,40}\b", text)
    assert len(hashes) <= 3, hashes
    cells = [c.strip() for line in text.splitlines() if line.startswith("|") for c in line.strip("|").split("|")]
    assert max(map(len, cells)) <= 160, max(cells, key=len)
    head = "\n".join(text.splitlines()[:120])
    assert "pip install" in head and "zd.DistributedOptimizer(" in head
