"""Write each example script's notebook twin: `# %%` starts a code cell, `# %% [markdown]` a markdown
cell. The tests check that every notebook holds exactly its script's cells. `--execute` runs each
notebook (nbclient, an ipykernel) so it is committed with its outputs and plots inline:
    python examples/make_notebooks.py --execute [--only a.py,b.py]"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).parent
SCRIPTS = ("llamaindex_quickstart.py", "langchain_quickstart.py", "tune_ratio.py")


def cells(script: str) -> list[tuple[str, str]]:
    """(kind, source) per cell of a `# %%` script."""
    out: list[tuple[str, list[str]]] = []
    for line in script.splitlines():
        if line.startswith("# %%"):
            out.append(("markdown" if "[markdown]" in line else "code", []))
            continue
        if out:
            out[-1][1].append(line[2:] if out[-1][0] == "markdown" and line.startswith("# ") else line)
    return [(kind, "\n".join(lines).strip("\n")) for kind, lines in out]


def notebook(script: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
                for kind, src in cells(script)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def main() -> int:
    execute = "--execute" in sys.argv[1:]
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else SCRIPTS
    for name in only:
        path = HERE / name
        nb = notebook(path.read_text())
        if execute:
            import tempfile

            from nbclient import NotebookClient

            with tempfile.TemporaryDirectory() as cwd:  # files a notebook writes stay out of the repository
                NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": cwd}}).execute()
        nbformat.write(nb, path.with_suffix(".ipynb"))
        print(f"wrote {path.with_suffix('.ipynb').name}{' (executed)' if execute else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
