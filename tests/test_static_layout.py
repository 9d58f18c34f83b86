"""The code's layout, checked statically (no processes): layers, cycles, sizes, raw collectives.

Layers, lowest first: errors/unwrap/spawn -> comm -> mesh -> layout -> attention -> data/loss -> memory ->
steps/rl -> hf -> train/trl -> planner -> bench -> cli/demo. A module may import its own layer or lower ones
(function-level imports count too: a lazy import upward is still a dependency upward). Inside train/ the
same rule holds for its parts: config -> model -> dataset -> grpo -> loop -> lifecycle -> run/verify.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import seqpar

SRC = Path(seqpar.__file__).parent

LAYERS = [
    {"errors", "unwrap", "spawn"},
    {"comm"},
    {"mesh"},
    {"layout"},
    {"attention"},
    {"data", "loss"},
    {"memory"},
    {"steps", "rl", "__init__"},  # the package root: `import seqpar` loads up to the shared step, no trainer
    {"hf"},
    {"train", "trl"},
    {"planner"},
    {"bench"},
    {"cli", "demo", "__main__"},
]
TRAIN_LAYERS = [{"config"}, {"model"}, {"dataset"}, {"grpo"}, {"loop"}, {"lifecycle"}, {"run", "verify"}]


def _rank(layers: list[set[str]], part: str) -> int:
    for i, names in enumerate(layers):
        if part in names:
            return i
    raise AssertionError(f"{part!r} is in no layer: add it to the layer list of tests/test_static_layout.py")


def _modules() -> dict[str, Path]:
    mods = {}
    for p in SRC.rglob("*.py"):
        parts = ("seqpar",) + p.relative_to(SRC).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """seqpar modules that `name` imports anywhere in its body (relative imports resolved)."""
    out: set[str] = set()
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in mods)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            for a in node.names:  # `from pkg import module` depends on the module, else on pkg itself
                sub = f"{base}.{a.name}"
                if sub in mods:
                    out.add(sub)
                elif base in mods:
                    out.add(base)
    out.discard(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_upward_imports():
    bad = []
    for src, deps in _graph().items():
        for dst in deps:
            if dst == "seqpar":
                continue  # the package root itself: every submodule's import runs it first anyway
            a, b = _part(src), _part(dst)
            if _rank(LAYERS, a) < _rank(LAYERS, b):
                bad.append(f"{src} -> {dst}")
            if a == b == "train" and src.count(".") > 1 and dst.count(".") > 1:
                ta, tb = src.split(".")[2], dst.split(".")[2]
                if _rank(TRAIN_LAYERS, ta) < _rank(TRAIN_LAYERS, tb):
                    bad.append(f"{src} -> {dst} (inside train/)")
    assert not bad, "imports against the layers:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    """No module reaches itself through imports (package __init__ files count as modules)."""
    edges = _graph()
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_train_path_sizes():
    """train/ and steps/: modules readable in one sitting (<= 400 lines), functions <= 60 lines."""
    bad = []
    for p in [*(SRC / "train").rglob("*.py"), *(SRC / "steps").rglob("*.py")]:
        text = p.read_text()
        if len(text.splitlines()) > 400:
            bad.append(f"{p.relative_to(SRC)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                bad.append(f"{p.relative_to(SRC)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not bad, bad


def test_import_seqpar_loads_no_trainer():
    code = ("import sys, seqpar; print(sorted(m for m in sys.modules if m.startswith(('seqpar.train', 'seqpar.trl', "
            "'seqpar.hf', 'seqpar.cli', 'seqpar.planner', 'seqpar.bench'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_readme_layout_map_matches_the_tree():
    """Every package and top-level module of seqpar is named in the README's "Where things live" map."""
    readme = (SRC.parents[1] / "README.md").read_text()
    section = readme.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    names = {p.stem for p in SRC.glob("*.py") if p.stem not in ("__init__", "__main__")}
    names |= {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {f"train/{p.name}" for p in (SRC / "train").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    missing = sorted(n for n in names if f"{n}/" not in section and f"{n}.py" not in section)
    assert not missing, f"README 'Where things live' does not mention: {missing}"


# ----------------------------------------------------------------------------- raw collectives
# torch.distributed calls that move tensors; barrier / init / queries carry none.
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter",
    "send", "recv", "isend", "irecv", "batch_isend_irecv",
}


def _raw_collective_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            base = ast.unparse(node.func.value)
            if base in ("dist", "torch.distributed"):
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {base}.{node.func.attr}")
    return found


def test_no_raw_collectives_outside_comm():
    """Every collective of the library goes through seqpar.comm (benchmarks, the machine calibration's raw
    micro-benchmarks and the spawn harness aside)."""
    skip = {"comm.py", "spawn.py", "planner/calibrate.py"}
    files = [p for p in SRC.rglob("*.py") if str(p.relative_to(SRC)) not in skip and "bench" not in p.parts]
    assert any(p.name == "step.py" for p in files)
    bad = [c for p in files for c in _raw_collective_calls(p)]
    assert not bad, bad
