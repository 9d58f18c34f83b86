"""tools/: the scripts that take seqpar's GPU checks to a machine with no network (docs/gpu.md).

gpu_wheels.sh needs the network and gpu_check.sh a CUDA GPU; what runs here: every script parses, and
gpu_install.sh installs a plain wheel and a wheel re-packed as .tar.xz (what gpu_wheels.sh makes of wheels over
8 MB) so that both import and importlib.metadata finds both.
"""

from __future__ import annotations

import io
import sys
import tarfile
import zipfile
from pathlib import Path

from procs import run_command

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _dist(name: str, version: str) -> dict[str, str]:
    """The files of a one-module distribution (module, METADATA, WHEEL; RECORD written by the caller)."""
    info = f"{name}-{version}.dist-info"
    return {f"{name}/__init__.py": f"VALUE = {version!r}\n",
            f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
            f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}


def _wheel(path: Path, name: str, version: str) -> None:
    files = _dist(name, version)
    files[f"{name}-{version}.dist-info/RECORD"] = "".join(f"{f},,\n" for f in files) + \
        f"{name}-{version}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for f, text in files.items():
            z.writestr(f, text)


def _packed(path: Path, name: str, version: str) -> None:
    with tarfile.open(path / f"{name}-{version}-py3-none-any.tar.xz", "w:xz") as t:
        for f, text in _dist(name, version).items():
            data = text.encode()
            info = tarfile.TarInfo(f"./{f}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))


def test_scripts_parse():
    for script in sorted(TOOLS.glob("*.sh")):
        r = run_command(["bash", "-n", str(script)], timeout=30)
        assert r.returncode == 0, (script.name, r.stderr)


def test_gpu_install_takes_wheels_and_packed_wheels(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "seqpar_plain_pkg", "1.2")
    _packed(wheels, "seqpar_packed_pkg", "3.4")
    # the python3 on PATH is the venv's here (make test), the machine's own there
    r = run_command(["bash", str(TOOLS / "gpu_install.sh"), str(wheels), str(site)], timeout=120,
                    env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr
    code = ("import importlib.metadata as m, seqpar_plain_pkg as a, seqpar_packed_pkg as b; "
            "print(a.VALUE, b.VALUE, m.version('seqpar-plain-pkg'), m.version('seqpar-packed-pkg'))")
    r = run_command([sys.executable, "-c", code], timeout=60, env={"PYTHONPATH": str(site)})
    assert r.stdout.split() == ["1.2", "3.4", "1.2", "3.4"], r.stdout + r.stderr
