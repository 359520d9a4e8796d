"""docs/architecture.md against the code: every import of the package (those inside functions included),
parsed with ``ast``, keeps the import rules; the layers have no import pointing up and no cycle; every
module has a row in the module table; every function the step table names exists."""

import ast
import os
import re

import pytest

from conftest import ROOT

DOC = os.path.join(ROOT, "docs", "architecture.md")
# where each installed package's files live (pyproject.toml's package-dir)
PACKAGES = {"trainrun": "trainrun", "trainrun.kernels": "kernels", "trainrun.data_tools": "data_tools"}


def modules() -> dict[str, str]:
    """Module name (without the ``trainrun.`` prefix, a package by its own name) -> file path; empty files
    (an empty ``__init__.py``) left out."""
    found = {}
    for package, folder in PACKAGES.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dirpath, f)
                if os.path.getsize(path) == 0:      # an empty __init__.py
                    continue
                rel = os.path.relpath(path, os.path.join(ROOT, folder))[:-3].replace(os.sep, ".")
                parts = package.split(".")[1:] + ([] if rel == "__init__" else rel.split("."))
                if parts and parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts) or "trainrun"] = path
    return found


def imports(name: str, path: str, known) -> tuple[set[str], set[str]]:
    """(trainrun modules imported, other top-level packages imported) by one module, anywhere in it."""
    tree = ast.parse(open(path).read(), path)
    is_package = path.endswith("__init__.py")
    ours, others = set(), set()
    here = ["trainrun"] + ([] if name == "trainrun" else name.split("."))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_package else here[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            targets = [f"{module}.{a.name}" for a in node.names]
            if not all(t[len("trainrun."):] in known for t in targets):     # `from . import base`: the
                targets.append(module)                                      # submodule, not its package
        else:
            continue
        for t in targets:
            if not t.startswith("trainrun"):
                others.add(t.split(".")[0])
                continue
            short = t[len("trainrun."):] if t != "trainrun" else "trainrun"
            while short not in known and "." in short:
                short = short.rsplit(".", 1)[0]
            if short in known and short != name and (short != "trainrun" or t == "trainrun"):
                ours.add(short)
    return ours, others


@pytest.fixture(scope="module")
def graph():
    found = modules()
    return {m: imports(m, p, found) for m, p in found.items()}


def layers(doc: str) -> dict[str, int]:
    """The layer table of architecture.md: ``layer N  module module ...`` lines in its fenced block."""
    block = doc.split("<!-- layers -->", 1)[1].split("```", 2)[1]
    order = {}
    for line in block.splitlines():
        m = re.match(r"\s*layer (\d+)\s+(.*)", line)
        if m:
            for mod in m.group(2).split():
                order[mod] = int(m.group(1))
    return order


def layer_of(module: str, order: dict[str, int]) -> int | None:
    """The layer of ``module``: by its name, or by a ``package.*`` entry covering it."""
    if module in order:
        return order[module]
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) + ".*" in order:
            return order[".".join(parts[:i]) + ".*"]
    return None


def violations(graph: dict, order: dict[str, int]) -> list[str]:
    """Every broken import rule, named by importer and imported."""
    bad = []
    config_package = {m for m in graph if m.split(".")[0] == "config"}
    for mod, (ours, others) in sorted(graph.items()):
        top = mod.split(".")[0]
        if top == "config" and (outside := ours - {"errors"} - config_package):
            bad.append(f"{mod} imports {sorted(outside)}: only errors")
        if top in ("data", "comm") and ("onnxruntime" in others or "step.engine" in ours):
            bad.append(f"{mod} imports onnxruntime or the engine")
        if top in ("models", "kernels") and (known := ours & {"run.runner", "step.engine", "data", "sync.update"}):
            bad.append(f"{mod} knows the runner / engine / data: {sorted(known)}")
        if top == "kernels" and ours - {"config"} - {m for m in graph if m.startswith("kernels.")}:
            bad.append(f"{mod} imports {sorted(ours)}: kernels/ import only config and each other")
        if top == "observe" and "run.runner" in ours:
            bad.append(f"{mod} imports the runner")
        if "click" in others and mod not in ("cli", "data_tools.cli"):
            bad.append(f"{mod} imports click (only cli and data_tools.cli do)")
        if "torch" in others:
            bad.append(f"{mod} imports torch (only tests/ and scripts/ do)")
        mine = layer_of(mod, order)
        if mine is None:
            bad.append(f"{mod} has no layer in docs/architecture.md")
            continue
        for other in sorted(ours):
            theirs = layer_of(other, order)
            if theirs is not None and theirs > mine:
                bad.append(f"{mod} (layer {mine}) imports {other} (layer {theirs}): an import up the layers")
    return bad


def cycles(graph: dict) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v][0]:
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
                found.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_keep_the_rules_and_the_layers(graph):
    doc = open(DOC).read()
    assert violations(graph, layers(doc)) == []
    assert cycles(graph) == []


def test_the_checks_catch_a_violation(graph):
    """Each kind of rule fails when broken: an import up the layers that closes a cycle, click outside the
    command lines, onnxruntime in data, torch anywhere, a module of the config package that imports the engine
    or the validity checks."""
    order = layers(open(DOC).read())
    broken = {m: (set(ours), set(others)) for m, (ours, others) in graph.items()}
    broken["step.flat"][0].add("step.engine")             # engine -> flat, so also a cycle
    broken["data"][1].add("onnxruntime")
    broken["comm.mpi"][1].add("onnxruntime")
    broken["step.engine"][1].update({"click", "torch"})
    broken["config"][0].add("step.engine")
    broken["config.load"][0].add("run.validity")
    broken["observe.metrics"][0].add("sync.update")
    found = "\n".join(violations(broken, order))
    for text in ("step.flat (layer 1) imports step.engine (layer 5)", "data imports onnxruntime",
                 "comm.mpi imports onnxruntime", "step.engine imports click", "step.engine imports torch",
                 "config imports ['step.engine']", "config.load imports ['run.validity']",
                 "observe.metrics (layer 2) imports sync.update (layer 5)"):
        assert text in found
    assert any({"step.engine", "step.flat"} <= set(c) for c in cycles(broken))


def test_every_module_has_a_row_in_the_module_table(graph):
    """A row names the module's file (``flat.py``, ``models/gpt2.py``) or its folder (``observe/``)."""
    doc = open(DOC).read()
    table = doc.split("## Who owns what", 1)[1].split("\n## ", 1)[0]
    named = set()
    for line in table.splitlines():
        if line.startswith("|"):
            named.update(re.findall(r"`([\w/.]+)`", line.split("|")[1]))
    missing = []
    for mod, path in modules().items():
        parts = mod.split(".")
        file = "/".join(parts) + ("/" if path.endswith("__init__.py") else ".py")
        folders = {"/".join(parts[:i]) + "/" for i in range(1, len(parts))} | \
            ({file} if file.endswith("/") else set())
        if mod == "trainrun" or not (file in named or named & folders):
            missing.append(file)
    assert missing == []


def test_the_step_table_names_functions_that_exist():
    doc = open(DOC).read()
    table = doc.split("`TrainingRunner.train_step` reads in the step's order:", 1)[1].split("```", 2)[1]
    called = set(re.findall(r"\.?(\w+)\(", table))
    defined = set()
    for path in modules().values():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defined.add(node.name)
    assert called and called - defined == set()


# where a model family may be named outside trainrun/models/: the config package's schema holds the built-in
# families' YAML sections (config/model.py) and documents keys of one family (config imports nothing of
# trainrun; docs/architecture.md says why), and data_tools/ makes each family's datasets (``trainrun-data bert``)
FAMILY_NAMES = re.compile(r"gpt-?2|bert", re.IGNORECASE)


def family_names(path: str) -> list[str]:
    """Where the code of ``path`` names a model family: string literals (docstrings aside) and
    identifiers (names, attributes, imported names), as ``line: text``."""
    tree = ast.parse(open(path).read(), path)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            text = node.value
        elif isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.alias):
            text = f"{node.name} as {node.asname}" if node.asname else node.name
        elif isinstance(node, ast.ImportFrom):
            text = node.module or ""
        else:
            continue
        if FAMILY_NAMES.search(text):
            found.append(f"{getattr(node, 'lineno', '?')}: {text[:80]!r}")
    return found


def test_no_module_outside_models_names_a_model_family():
    """A model family is one place: trainrun/models/<family>.py registers everything trainrun knows of
    it (trainrun/models/registry.py); every other module asks the registry."""
    named = {}
    for mod, path in modules().items():
        if mod.split(".")[0] in ("config", "models", "data_tools"):
            continue
        if found := family_names(path):
            named[mod] = found
    assert named == {}


def test_the_family_check_catches_a_family_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""A GPT-2 docstring is fine."""\nfrom .models.gpt2 import build\n'
                   'def f(cfg):\n    return cfg.model.bert if cfg.model.builtin == "bert" else None\n')
    found = family_names(str(bad))
    assert any("models.gpt2" in f for f in found) and sum("bert" in f for f in found) == 2, found


# a module a reader holds at once: none of trainrun's longer than MAX_LINES
MAX_LINES = 700


def test_no_module_is_longer_than_max_lines():
    lines = {m: sum(1 for _ in open(p)) for m, p in modules().items()}
    assert {m: n for m, n in lines.items() if n > MAX_LINES} == {}


# what may sit flat in trainrun/ beside its packages (the floors): the command line, the errors, the fault hooks
# of the tests, the datasets
FLAT = {"__init__", "cli", "errors", "faults", "data"}


def test_the_floors_are_folders():
    """``ls trainrun`` shows where the step, the sync, the run and the commands live: every other module is in
    a package, and every package's ``__init__.py`` opens with a docstring that says its job."""
    top = os.path.join(ROOT, "trainrun")
    flat = {f[:-3] for f in os.listdir(top) if f.endswith(".py")}
    assert flat - FLAT == set()
    packages = sorted(d for d in os.listdir(top) if os.path.isfile(os.path.join(top, d, "__init__.py")))
    assert {"run", "step", "sync", "commands", "hf"} <= set(packages)
    undocumented = [p for p in packages
                    if not ast.get_docstring(ast.parse(open(os.path.join(top, p, "__init__.py")).read()))]
    assert undocumented == []


def test_the_runner_holds_no_branch_on_the_sync_mode():
    """The runner only calls the sync policy's interface (trainrun/sync/policy.py's ``Policy``): it reads none
    of its attributes (how many replicas, which communicator) to decide anything itself."""
    from trainrun.sync.policy import EveryStep, Policy
    from trainrun.sync.diloco import DiLoCo
    interface = {n for cls in (Policy, EveryStep, DiLoCo) for n, v in vars(cls).items()
                 if callable(v) and not n.startswith("_")}
    tree = ast.parse(open(modules()["run.runner"]).read())
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute) and node.value.attr == "sync"}
    assert read and read - interface == set()
    assert {"world_step", "scalars", "maybe_outer_step"} <= read


def test_no_module_reads_another_modules_private_names(graph):
    """``module._name`` of a trainrun module imported as ``module`` (a constant of ``update``, say): a private
    name stays in its module; another module gets a public one."""
    found = modules()
    bad = []
    for mod, path in found.items():
        tree = ast.parse(open(path).read())
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                aliases.update(a.asname or a.name for a in node.names
                               if node.level or (node.module or "").startswith("trainrun"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                bad.append(f"{mod}: {node.value.id}.{node.attr}")
    assert bad == []
