"""The code's layout, checked statically (no processes): layers, cycles, sizes, raw collectives.

Layers, lowest first: errors/unwrap/spawn/textfiles -> comm -> mesh -> layout -> attention/recurrent ->
data/loss/dynamic -> memory -> steps/rl -> hf -> train/trl -> planner -> bench -> cli/demo. A module may import its
own layer or lower ones
(function-level imports count too: a lazy import upward is still a dependency upward). Inside train/ the
same rule holds for its parts: config -> model -> dataset -> grpo -> loop -> lifecycle -> run/verify.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from procs import run_command

import seqpar

SRC = Path(seqpar.__file__).parent

LAYERS = [
    {"errors", "unwrap", "spawn", "textfiles", "threaded"},
    {"comm"},
    {"mesh"},
    {"layout"},
    {"attention", "recurrent"},
    {"data", "loss", "dynamic"},
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


# ----------------------------------------------------------------------------- sizes
# Modules readable in one sitting, functions on one screen: the whole library, benchmarks included (the same
# bound: the attention benchmark is a package of one module per part).
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
SIZE_EXEMPT: tuple[str, ...] = ()  # top-level packages exempt from the rule (none)


def _size_violations(root: Path, exempt: tuple[str, ...] = SIZE_EXEMPT) -> list[str]:
    """Every module of `root` over MAX_MODULE_LINES and every function or method (nested ones too) over
    MAX_FUNCTION_LINES (from its `def` line to its last), outside the exempt top-level packages."""
    bad = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if rel.parts[0] in exempt:
            continue
        text = p.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            bad.append(f"{rel}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            n = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and n > MAX_FUNCTION_LINES:
                bad.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    return bad


def test_sizes():
    """Every module <= 400 lines, every function <= 60 lines, in every package."""
    bad = _size_violations(SRC)
    assert not bad, bad


def test_size_rule_catches_a_planted_oversize_anywhere(tmp_path):
    """An oversized module and an oversized method planted in every folder of the library are each reported,
    except in the exempt package: the rule reaches the whole tree, bench/ included."""
    folders = sorted({p.parent.relative_to(SRC) for p in SRC.rglob("*.py")})
    assert Path("bench") in folders and Path("train/model") in folders
    body = "".join(f"        y = {i}\n" for i in range(MAX_FUNCTION_LINES))  # def + 60 = 61 lines
    for f in folders:
        (tmp_path / f).mkdir(parents=True, exist_ok=True)
        (tmp_path / f / "planted_module.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
        (tmp_path / f / "planted_function.py").write_text(f"class C:\n    def long(self):\n{body}")
    found = _size_violations(tmp_path)
    for f in folders:
        want = not (f.parts and f.parts[0] in SIZE_EXEMPT)
        assert any(x.startswith(f"{f / 'planted_module.py'}: ") for x in found) == want, f
        assert any(x.startswith(f"{f / 'planted_function.py'}:2 long: ") for x in found) == want, f
    assert len(found) == 2 * sum(not (f.parts and f.parts[0] in SIZE_EXEMPT) for f in folders)
    assert _size_violations(tmp_path, exempt=()) and len(_size_violations(tmp_path, exempt=())) == 2 * len(folders)


def test_no_private_names_imported_across_modules():
    """What a module shares is public: no `from seqpar... import _name` between seqpar's modules."""
    bad = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("seqpar")):
                bad += [f"{name}: {a.name}" for a in node.names if a.name.startswith("_") and a.name != "__version__"]
    assert not bad, bad


def test_import_seqpar_loads_no_trainer():
    code = ("import sys, seqpar; print(sorted(m for m in sys.modules if m.startswith(('seqpar.train', 'seqpar.trl', "
            "'seqpar.hf', 'seqpar.cli', 'seqpar.planner', 'seqpar.bench'))))")
    out = run_command([sys.executable, "-c", code], timeout=120)
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


def test_pyproject_license_is_an_spdx_expression():
    """PEP 639: `license = "Apache-2.0"` (a table made setuptools print its deprecation banner at every build), which
    needs setuptools >= 77 in build-system.requires. (Checked by hand: `pip wheel --no-deps` builds it from the local
    package index, METADATA `License-Expression: Apache-2.0`, no banner.)"""
    import tomllib
    from packaging.requirements import Requirement

    root = SRC.parents[1]
    meta = tomllib.loads((root / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    (req,) = [Requirement(r) for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert not req.specifier.contains("76.9") and req.specifier.contains("77.0"), req
