"""Every config key a message or a doc names exists: dotted `section.key` names in the strings of src/seqpar (error
messages, hints, printed lines; not docstrings) and in README.md / docs/*.md are checked against TrainConfig's schema
(static: no processes). A message that tells a user to set `grpo.nucleus` when there is no such key fails here.
Only dotted names are seen: a bare option word (the old GRPO hint's "top_k", when grpo.top_k was no key) is not.
"""

from __future__ import annotations

import ast
import re
import typing
from pathlib import Path

from pydantic import BaseModel

import seqpar
from seqpar.train.config import TrainConfig

SRC = Path(seqpar.__file__).parent
ROOT = SRC.parents[1]
# Python objects, not config keys, that messages and docs name with a section's word in front.
PYTHON_NAMES = {"model.config", "model.model", "model.generate", "model.language_model", "model.lm_head",
                "checkpoint.load_universal", "memory.checkpointing"}
FILE_NAME = re.compile(r"\.(md|py|json|jsonl|yaml|bin|safetensors|pt|png|txt)$")


def _keys(model: type[BaseModel], prefix: str = "") -> tuple[set[str], set[str]]:
    """(every dotted key of `model`, the dict-valued ones: any sub-key of those is the user's)."""
    keys, free = set(), set()
    for name, field in model.model_fields.items():
        full = prefix + name
        keys.add(full)
        for t in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(t, type) and issubclass(t, BaseModel):
                k, f = _keys(t, full + ".")
                keys, free = keys | k, free | f
            elif t is dict or typing.get_origin(t) is dict:
                free.add(full)
    return keys, free


KEYS, FREE = _keys(TrainConfig)
SECTIONS = sorted({k.split(".")[0] for k in KEYS if "." in k})
PATTERN = re.compile(r"(?<![\w./])(" + "|".join(SECTIONS) + r")((?:\.[A-Za-z_]\w*)+)(?![\w(/])")


def _unknown(text: str) -> list[str]:
    out = []
    for m in PATTERN.finditer(text):
        key = m.group(1) + m.group(2)
        parts = key.split(".")
        prefixes = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        if key in KEYS or FILE_NAME.search(key) or prefixes & PYTHON_NAMES or (prefixes - {key}) & FREE:
            continue
        out.append(key)
    return out


def test_scanner_sees_a_missing_key():
    assert _unknown("lower grpo.temperature, grpo.top_p or grpo.nucleus") == ["grpo.nucleus"]
    assert _unknown("set model.kwargs.vocab_size >= 300; see docs/grpo.md; seqpar.memory.meter") == []
    assert {"grpo.top_k", "dataset.train_on_prompt", "memory.tiled_mlp", "fsdp.offload"} <= KEYS


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def test_every_key_named_in_the_code_exists():
    """Every string but docstrings (they name modules and methods: grpo.rollout, optimizer.step)."""
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                bad += [f"{path.relative_to(SRC)}:{node.lineno}: {k}" for k in _unknown(node.value)]
    assert not bad, "strings name config keys the schema lacks:\n" + "\n".join(bad)


def test_every_key_named_in_the_docs_exists():
    bad = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        generated = False  # the family sweep's table quotes transformers' module paths (model.layers.0...)
        for i, line in enumerate(path.read_text().splitlines(), 1):
            generated = (generated or "family-sweep:begin" in line) and "family-sweep:end" not in line
            if not generated:
                bad += [f"{path.name}:{i}: {k}" for k in _unknown(line)]
    assert not bad, "docs name config keys the schema lacks:\n" + "\n".join(bad)
