"""The package's dependencies run one way (docs/guide.md, "Layout"): entry points (cli, serve, integrations,
evaluation, transfer, distributed) -> engine -> methods -> stages (load, select, group, recompute, planning,
decode) -> store and models; no module imports one above it, and there are no import circles. Read from the
source with `ast` (imports inside functions count too), so a new module or import is checked at once."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the layers are folders (and a few modules) of the package: each name's rank, 0 the top
RANKS = {**dict.fromkeys(("cli", "serve", "integrations", "evaluation", "transfer", "distributed", "handbook", "testing", "object_server"), 0),
         "engine": 1, "methods": 2, "stages": 3, **dict.fromkeys(("store", "models", "config", "kernels"), 4)}


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in ((ROOT / "cacheclip_rag", "cacheclip_rag"), (ROOT / "integrations", "cacheclip_rag.integrations"),
                            (ROOT / "kernels", "cacheclip_rag.kernels")):
        for file in folder.rglob("*.py"):
            parts = file.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            out[name.removesuffix(".__init__")] = file
    return out


def imports(name: str, file: Path, known: dict[str, Path]) -> set[str]:
    package = name if file.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            candidates = [f"{target}.{a.name}" for a in node.names] + ([target] if node.module else [])
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found |= {c for c in candidates if c in known and c not in (name, "cacheclip_rag")}
    return found


def rank(module: str) -> int:
    return RANKS[module.split(".")[1]]


def test_every_module_is_in_a_layer_and_few_stay_at_the_top():
    names = {m.split(".")[1] for m in graph()}
    assert names <= set(RANKS), names - set(RANKS)
    top_modules = [f for f in (ROOT / "cacheclip_rag").glob("*.py") if f.name != "__init__.py"]
    assert len(top_modules) <= 8, top_modules


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, file, known) for name, file in known.items() if name != "cacheclip_rag"}


def test_no_module_imports_one_above_it():
    upward = [(m, t) for m, targets in graph().items() for t in targets if rank(t) < rank(m)]
    assert upward == []


def test_there_are_no_import_circles():
    edges, circles = graph(), []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert circles == []


def test_the_checker_sees_an_upward_import():
    """A test that can fail: a stage importing the engine is caught."""
    fake = {"cacheclip_rag.stages.select.selection": {"cacheclip_rag.engine.core"}}
    assert [(m, t) for m, ts in fake.items() for t in ts if rank(t) < rank(m)] == [("cacheclip_rag.stages.select.selection",
                                                                                     "cacheclip_rag.engine.core")]
    assert "cacheclip_rag.engine.core" in graph()["cacheclip_rag.serve.app"]


def test_one_list_of_methods():
    """The method names the CLI and config check without torch (`config.METHODS`) are the prefills' keys."""
    from cacheclip_rag.config import METHODS
    from cacheclip_rag.methods.prefills import PREFILLS

    assert tuple(PREFILLS) == METHODS


def test_the_server_plans_recognises_and_schedules_through_the_engine():
    """`serve/` once re-did `Engine.stream_prompt` (its own recognition, question and layout); it now calls
    `Engine.plan_prompt`, so the two paths cannot drift."""
    inside = {"cacheclip_rag.engine.planning", "cacheclip_rag.engine.recognize", "cacheclip_rag.engine.prompts"}
    reached = {t for m, targets in graph().items() if m.startswith("cacheclip_rag.serve.") for t in targets}
    assert reached & inside == set()
    assert not any(t.startswith("cacheclip_rag.stages.decode") for t in reached)  # the decode loop: engine.scheduler
