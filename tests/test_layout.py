"""The module layout's rules, checked on the source: the runtime's import graph has no cycle, core
subsystems never import a model family, the expert path and the decode graphs import nothing of
each other, the runtime never imports the compiler, and an engine imports only the family it runs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[1] / "runtime" / "ftc_runtime"
PACKAGE = "ftc_runtime"
CORE = ("experts", "cache", "decode", "serve", "io")
# What a core module may import from models/: the registry and the record type, never a family.
CORE_MAY_IMPORT = (f"{PACKAGE}.models", f"{PACKAGE}.models.base")
# Subsystem folders with no import arrow between them, in either direction.
UNRELATED = (("experts", "decode"),)


def runtime_modules() -> dict[str, Path]:
    mods = {}
    for f in RUNTIME.rglob("*.py"):
        parts = list(f.relative_to(RUNTIME).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join([PACKAGE, *parts])] = f
    return mods


def imported_names(module: str, path: Path) -> set[str]:
    """Every module named by an import statement anywhere in the file (inside functions and under
    TYPE_CHECKING too), relative imports resolved."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            names.add(target)
            names |= {f"{target}.{a.name}" for a in node.names}
    return names


def import_graph() -> dict[str, set[str]]:
    """Module → the runtime modules it imports."""
    mods = runtime_modules()
    graph = {}
    for m, path in mods.items():
        deps = set()
        for name in imported_names(m, path):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != m:
                deps.add(name)
        graph[m] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), but a package's __init__
    importing its own submodules (a registry) is not one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return [c for c in found if not all(x == c[0] or x.startswith(c[0] + ".") for x in c)]


def test_the_runtime_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "p": {"p.x"}, "p.x": {"p"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_core_subsystems_never_import_a_model_family():
    arrows = [(m, d) for m, deps in import_graph().items() if m.count(".") and m.split(".")[1] in CORE
              for d in deps if d.startswith(f"{PACKAGE}.models") and d not in CORE_MAY_IMPORT]
    assert arrows == []
    assert all((RUNTIME / sub).is_dir() for sub in CORE)


def crossings(graph: dict[str, set[str]], a: str, b: str) -> list[str]:
    """The import arrows between subsystem folders a and b, either way, as "importer -> imported"."""
    def folder(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else None

    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if {folder(m), folder(d)} == {a, b})


def test_the_expert_path_and_the_decode_graphs_import_nothing_of_each_other():
    """experts/ (the backends, and under experts/device/ the device plan, the doorbell and the
    one-graph step's MoE layer) never imports decode/, and decode/ (the graph machinery, which
    knows no family and no experts) never imports experts/: the graphs drive the expert backend
    through the model's `experts` object alone, and their timeline is a protocol of their own
    (`graphs.StepTimeline`), which the expert path's `DeviceTimeline` meets."""
    graph = import_graph()
    for a, b in UNRELATED:
        arrows = crossings(graph, a, b)
        assert arrows == [], f"{a}/ and {b}/ import each other's modules: " + "; ".join(arrows)


def test_the_crossing_finder_finds_either_direction():
    p = PACKAGE
    graph = {f"{p}.experts.x": {f"{p}.decode.g", f"{p}.io.y"}, f"{p}.decode.g": {f"{p}.experts"},
             f"{p}.decode": set(), f"{p}.experts": set(), f"{p}.io.y": set()}
    assert crossings(graph, "experts", "decode") == [f"{p}.decode.g -> {p}.experts", f"{p}.experts.x -> {p}.decode.g"]
    assert crossings(graph, "experts", "io") == [f"{p}.experts.x -> {p}.io.y"]


def test_no_family_imports_another():
    """Families share code through models/layers and models/base, so that each package stands alone."""
    def family_of(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == "models" and parts[2] not in ("layers", "base") \
            and (RUNTIME / "models" / parts[2]).is_dir() else None

    arrows = [(m, d) for m, deps in import_graph().items() if family_of(m)
              for d in deps if family_of(d) not in (None, family_of(m))]
    assert arrows == []


def test_the_runtime_never_imports_the_compiler():
    offenders = [(m, n) for m, path in runtime_modules().items() for n in imported_names(m, path)
                 if n == "ftc" or n.startswith(("ftc.", "ftc_templates"))]
    assert offenders == []


def test_a_qwen3_moe_engine_imports_no_other_family(engine_dir):
    """The registry imports a family on first use: serving Qwen3-MoE never loads the hybrid
    family's code or flash-linear-attention."""
    probe = ("import sys; from ftc_runtime import Engine; "
             f"e = Engine.load({str(engine_dir)!r}); e.generate([1, 2, 3], max_new_tokens=2); "
             "print(sorted(m for m in sys.modules if m.startswith(('ftc_runtime.models.qwen3_next', 'fla', "
             "'ftc_runtime.models.layers.gated_deltanet', 'ftc'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    loaded = ast.literal_eval(out.strip().splitlines()[-1])
    assert [m for m in loaded if not m.startswith("ftc_runtime")] == []
    assert [m for m in loaded if "qwen3_next" in m or "gated_deltanet" in m] == []


def test_a_cpu_engine_starts_without_dynamo_or_triton(engine_dir):
    """torch._dynamo alone takes seconds to import: loading and running an engine on the CPU (a
    prompt after cached tokens included) imports neither it nor Triton."""
    probe = ("import sys; from ftc_runtime import Engine; "
             f"e = Engine.load({str(engine_dir)!r}); c = e.model.new_cache(); "
             "e.prefill(__import__('torch').tensor([1, 2, 3]), c); e.prefill(__import__('torch').tensor([4, 5]), c); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton' or m.startswith('torch._dynamo')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert ast.literal_eval(out.strip().splitlines()[-1]) == []


def test_a_cpu_hybrid_engine_never_imports_flash_linear_attention(tmp_path):
    """flash-linear-attention (and Triton under it) are for GPU calls only: a hybrid engine on the
    CPU, prompt and decode, never imports them, even where they are installed. A stand-in `fla`
    package on the path shows any import of it."""
    from ftc.compile.pipeline import CompileOptions, compile_engine

    spec = Path(__file__).resolve().parents[1] / "model_specs" / "qwen3.6-moe-tiny.yaml"
    engine = compile_engine(CompileOptions(source=spec, target="cpu", random_weights=True, output=tmp_path / "e"))
    (tmp_path / "site" / "fla").mkdir(parents=True)
    (tmp_path / "site" / "fla" / "__init__.py").write_text("")
    probe = ("import sys; from ftc_runtime import Engine; "
             f"e = Engine.load({str(engine)!r}); e.generate([1, 2, 3, 4], max_new_tokens=3); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fla', 'triton')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(tmp_path / "site")}).stdout
    assert ast.literal_eval(out.strip().splitlines()[-1]) == []

