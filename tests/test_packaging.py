"""The project runs where it cannot be installed (the GPU machine: no package index) and on every
transformers release from 5.17 (that machine's) to the newest."""

import importlib.util
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from cacheclip_rag.stages.recompute.forward import cache_argument

ROOT = Path(__file__).resolve().parents[1]


def in_plain_checkout(code: str, cwd: Path) -> str:
    """What `code` prints with the checkout on PYTHONPATH and no install (the editable finder removed)."""
    code = "import sys; sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f).lower()];" + code
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, check=True).stdout


def test_kernels_and_integrations_import_from_a_plain_checkout(tmp_path):
    """No install, only PYTHONPATH: the kernels and integrations still resolve under cacheclip_rag,
    to the checkout's own files (not an installed copy)."""
    out = in_plain_checkout("import cacheclip_rag.kernels.selected_attention as k, cacheclip_rag.integrations.common as c;"
                            "print(k.__file__); print(c.__file__)", tmp_path).split()
    assert out == [str(ROOT / "kernels" / "selected_attention.py"), str(ROOT / "integrations" / "common.py")]


def test_no_top_level_import_name_of_the_checkout_shadows_a_package():
    """`python -m pytest`, a script or a notebook puts the checkout's root first on sys.path. A
    `kernels/__init__.py` there once shadowed Hugging Face's `kernels` package, which transformers >= 5.25
    imports, and no model could be loaded. From the root, `kernels` and `integrations` must be at most
    namespace portions (a real package of that name wins), never regular packages or modules of the
    checkout's root. A virtual environment inside the checkout (`.venv`) is not the checkout's source: the
    real package found in its site-packages is the right answer."""
    code = (
        "import importlib.util, json;"
        "specs = {n: importlib.util.find_spec(n) for n in ('kernels', 'integrations')};"
        "print(json.dumps({n: s.origin if s else None for n, s in specs.items()}))"
    )
    origins = json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                        check=True).stdout)
    for name, origin in origins.items():
        found = None if origin is None else Path(origin).resolve()
        assert found is None or not (found.is_relative_to(ROOT / name) or found == ROOT / f"{name}.py"), (name, origin)


def test_hugging_face_kernels_is_not_shadowed_from_the_repo_root():
    """The failure a newcomer met: from the root, transformers (which imports `kernels`) and the engine
    import, and `kernels` is the installed package, not the checkout's folder."""
    spec = importlib.util.find_spec("kernels")
    if spec is None or spec.origin is None or Path(spec.origin).resolve().is_relative_to(ROOT):
        pytest.skip("Hugging Face's kernels package is not installed (transformers < 5.25 does not need it)")
    code = ("import kernels, transformers; from cacheclip_rag.engine.core import Engine; "
            "import cacheclip_rag.kernels.selected_attention as k; print(kernels.__file__); print(k.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert not Path(out[0]).resolve().is_relative_to(ROOT), out[0]
    assert Path(out[1]) == ROOT / "kernels" / "selected_attention.py"


def test_a_plain_checkout_maps_only_the_kernels_and_integrations(tmp_path):
    """The checkout's root holds tests/, bench/ and examples/ too: none of them may become
    `cacheclip_rag.tests` and the like."""
    out = in_plain_checkout("import importlib.util, cacheclip_rag;"
                            "print([n for n in ('tests', 'bench', 'examples', 'scripts') "
                            "if importlib.util.find_spec('cacheclip_rag.' + n)])", tmp_path).strip()
    assert out == "[]"


def test_the_wheel_and_the_sdist_carry_the_kernels_and_integrations(tmp_path):
    """The folders have no `__init__.py` (see above); the built distributions must still carry them,
    under `cacheclip_rag/` in the wheel and as the source folders in the sdist; and the licences."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    source = tmp_path / "src"
    for name in tracked:
        if (name.startswith(("cacheclip_rag/", "kernels/", "integrations/", "LICENSES/"))
                or name in ("pyproject.toml", "README.md")) \
                and (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    def build(kind: str) -> str:  # one process per build: setuptools keeps the first build's options
        code = f"import sys; from setuptools import build_meta as b; print('built', b.build_{kind}(sys.argv[1]))"
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dist")], cwd=source, capture_output=True,
                             text=True, check=True).stdout.splitlines()
        return next(line.split()[1] for line in out if line.startswith("built "))

    wheel, sdist = build("wheel"), build("sdist")
    wheel_names = set(zipfile.ZipFile(tmp_path / "dist" / wheel).namelist())
    assert {"cacheclip_rag/kernels/selected_attention.py", "cacheclip_rag/integrations/langchain.py",
            "cacheclip_rag/integrations/llamaindex.py"} <= wheel_names
    assert not any(n.startswith(("kernels/", "integrations/")) for n in wheel_names)
    with tarfile.open(tmp_path / "dist" / sdist) as archive:
        sdist_names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    assert {"kernels/selected_attention.py", "integrations/langchain.py"} <= sdist_names
    licences = {n.split("/", 1)[1] for n in tracked if n.startswith("LICENSES/")}
    assert licences  # the embedded models' licences: in both distributions
    assert {f"LICENSES/{n}" for n in licences} <= sdist_names
    assert all(any(w.endswith(f".dist-info/licenses/LICENSES/{n}") for w in wheel_names) for n in licences), wheel_names


def test_gpu_scripts_parse():
    for script in ("bench/gpu_check.sh", "scripts/gpu_wheels.sh", "scripts/test_loop.sh", "scripts/test_transformers_min.sh"):
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)


class _NewForward:
    def forward(self, input_ids=None, cache=None, use_cache=None): ...


class _OldForward:
    def forward(self, input_ids=None, past_key_values=None, use_cache=None): ...


class _NoCache:
    def forward(self, input_ids=None): ...


def test_the_cache_argument_follows_the_forward_signature():
    """transformers 5.24 renamed past_key_values to cache, and each release silently drops the name it
    does not know; the name must come from the signature."""
    assert cache_argument(_NewForward) == "cache"
    assert cache_argument(_OldForward) == "past_key_values"
    with pytest.raises(TypeError, match="neither"):
        cache_argument(_NoCache)
