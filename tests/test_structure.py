"""The shape of the code: an acyclic import graph, every number of the schema range-checked, a user's keys
winning over a smoke block, the pass arithmetic of a resume, and a model that does not compile as one line."""
import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from ampzoo.config import Config, RANGES
from ampzoo.engine.load import check_command_line, load_config

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ampzoo", "amp", "cpu_kernels", "bench")  # the four importable names (pyproject.toml)
SCRIPTS = ("train", "eval", "export", "doctor")  # the root scripts: run, never imported

# The architecture, bottom up. A module may import its own layer and the layers below it, never one above.
# A module belongs to the layer of the longest prefix that names it.
LAYERS = [
    ("the CPU kernels: an extension that imports nothing of the zoo", ["cpu_kernels"]),
    ("core: errors, registry, config schema, composition, options, MindSpore set-up", ["ampzoo"]),
    ("networks and data: the model zoo's Cells, decoding, the readers and pipelines",
     ["ampzoo.models", "ampzoo.data"]),
    ("the AMP library: policy, loss scaling, telemetry, divergence watch, profiler", ["ampzoo.amp"]),
    ("the engine: config loading, loss and optimizer, checkpoints, callbacks, run directories, weights",
     ["ampzoo.engine"]),
    ("the process: train.py's command line and sweep, its run directory as one object, the one line of a failed "
     "step, train.log", ["ampzoo.engine.process"]),
    ("commands: the drivers, the self-check, the AMP tools (python -m amp.report | amp.audit | amp.search) and the "
     "release tooling (reproduce, verify, ship, the FP32-vs-AMP matrix)",
     [*SCRIPTS, "amp", "bench"]),
    ("the lab: one-off experiments, each answered in docs/benchmarks.md; nothing imports them", ["bench.lab"]),
]


def project_modules():
    modules = {}
    for path in ROOT.glob("*.py"):
        modules[path.stem] = path
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


# Calls that run or import a module named by a string: an edge as real as an import statement's
BY_NAME = {"run_module", "import_module", "run_path"}


def imported(source: str, modules) -> set:
    """The project modules a source imports anywhere in its body (top level or inside functions), and the ones it
    runs or imports by a string (runpy.run_module("x"), runpy.run_path("x.py"), importlib.import_module("x")): a
    shim that starts a module by name cannot hide the edge."""
    edges = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            edges.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                edges.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str) and \
                getattr(node.func, "attr", getattr(node.func, "id", None)) in BY_NAME:
            name = node.args[0].value
            if name.endswith(".py"):
                name = ".".join(Path(name).with_suffix("").parts).removesuffix(".__init__")
            edges.add(name)
    return {e for e in edges if e in modules}


def import_graph():
    """module -> the project modules it imports (or runs by name)."""
    modules = project_modules()
    return {name: sorted(imported(path.read_text(), modules) - {name}) for name, path in modules.items()}


def test_a_runpy_edge_would_be_found():
    modules = {"amp.report", "amp.report.command", "train", "ampzoo.engine.load"}
    source = ("import importlib, runpy\n"
              "runpy.run_module('amp.report.command', run_name='__main__')\n"
              "def later():\n    runpy.run_path('train.py')\n"
              "importlib.import_module('ampzoo.engine.load')\n")
    assert imported(source, modules) == {"amp.report.command", "train", "ampzoo.engine.load"}


def find_cycle(graph):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None
    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_is_acyclic():
    graph = import_graph()
    assert {"ampzoo.config", "ampzoo.engine.load", "ampzoo.errors", "ampzoo.models", "ampzoo.data", "train"} \
        <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    assert graph["ampzoo.errors"] == [] and graph["ampzoo.registry"] == ["ampzoo.errors"], \
        "the leaves import nothing of ours"
    assert graph["ampzoo.config"] == [], "the schema imports nothing of ours"


# The units of the package graph: a top-level package, or one of these parts of one (ampzoo's core, its engine and
# its data are three units; the amp library and each of its commands are units of their own; the lab is one)
UNITS = ("ampzoo.engine", "ampzoo.data", "ampzoo.models", "ampzoo.amp", "amp.report", "amp.audit", "amp.search",
         "bench.lab")


def unit_of(module: str) -> str:
    return next((u for u in UNITS if module == u or module.startswith(u + ".")), module.split(".")[0])


def package_graph(graph):
    """The same edges between units (train.py, eval.py, export.py are units of their own)."""
    packages = {}
    for a, targets in graph.items():
        packages.setdefault(unit_of(a), set()).update(unit_of(b) for b in targets)
    return {p: sorted(t - {p}) for p, t in packages.items()}


def test_the_models_are_written_without_the_cpu_kernels():
    """The models are plain MindSpore (issue 78): nothing in ampzoo/models/ names the CPU kernels or exists for them
    (a first layer's input_grad, a plain= layout, a branch whose gradients a kernel sums); build_model applies them
    to the finished network (ampzoo.engine.network)."""
    import re
    found = [f"{path.name}:{i}: {line.strip()}" for path in sorted((ROOT / "ampzoo" / "models").glob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"cpu_kernels|input_grad|plain=|branch\(|kernel(?!_size)", line)]
    assert found == []


def test_the_top_level_packages_form_layers():
    """The importable packages import downward only (issue 78): the commands (amp's, bench's) -> ampzoo (its
    core, models, data, AMP library and engine) -> cpu_kernels, which imports nothing of the zoo."""
    top = {}
    for a, targets in import_graph().items():
        top.setdefault(a.split(".")[0], set()).update(b.split(".")[0] for b in targets)
    top = {p: sorted(t - {p}) for p, t in top.items()}
    assert find_cycle(top) is None, " -> ".join(find_cycle(top))
    assert top["cpu_kernels"] == [] and top["ampzoo"] == ["cpu_kernels"]
    assert "bench" not in top["amp"] and "amp" not in top["ampzoo"]


def test_the_package_graph_is_acyclic():
    """The AMP library is one the engine builds on: a command that imports the engine (python -m amp.report |
    amp.audit | amp.search) is a unit of its own, and the library imports neither it nor the engine."""
    packages = package_graph(import_graph())
    assert {"ampzoo", "ampzoo.engine", "ampzoo.data", "ampzoo.amp", "amp.report", "bench", "bench.lab"} <= set(packages)
    assert find_cycle(packages) is None, " -> ".join(find_cycle(packages))
    assert not {"ampzoo.engine", "amp.report", "amp.audit", "amp.search"} & set(packages["ampzoo.amp"])
    assert "ampzoo.engine" in packages["amp.report"], "the commands are units: their edges count"
    assert [p for p, targets in packages.items() if "bench.lab" in targets] == [], "the product imports no experiment"


def test_a_cycle_between_units_would_be_found():
    graph = {"ampzoo.amp.policy": ["amp.report.command"], "amp.report.command": ["ampzoo.engine.load"],
             "ampzoo.engine.load": ["ampzoo.amp.policy"]}
    assert find_cycle(package_graph(graph)) == ["amp.report", "ampzoo.engine", "ampzoo.amp", "amp.report"]


def test_nothing_imports_a_root_script():
    """train.py, eval.py, export.py and doctor.py are commands the user runs; no module of the four packages imports
    them (or runs them by name), so what a package needs of a driver lives in the package."""
    importers = {a: [b for b in targets if b in SCRIPTS] for a, targets in import_graph().items()
                 if a.split(".")[0] in PACKAGES}
    assert {a: b for a, b in importers.items() if b} == {}


def test_only_the_four_packages_are_importable(tmp_path):
    """From a folder of the user's, the installed checkout (make install: pip install -e .) gives exactly the four
    packages: the root scripts and the old top-level names (models, since it moved into ampzoo) are not
    importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GLOG_v")}
    code = ("import importlib.util as u\n"
            "import ampzoo, amp, bench, cpu_kernels\n"
            "print(sorted(n for n in ('train', 'eval', 'export', 'doctor', 'zoo', 'engine', 'data', 'tools', 'lab', "
            "'models') "
            "if u.find_spec(n) is not None))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:] + "\n(make install puts the four packages into the venv)"
    assert out.stdout.split("\n")[-2] == "[]"
    usage = subprocess.run([sys.executable, "-m", "amp.report", "--help"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
    assert usage.returncode == 0 and "python -m amp.report recipe=" in usage.stdout, usage.stderr[-2000:]


def layer_of(module: str) -> int:
    best = max(((len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[1]


def arrows_up(graph):
    return [f"{a} ({LAYERS[layer_of(a)][0].split(':')[0]}) imports {b} ({LAYERS[layer_of(b)][0].split(':')[0]})"
            for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a)]


def test_no_import_runs_up_the_layers():
    graph = import_graph()
    assert arrows_up(graph) == []
    assert {layer_of(m) for m in graph} == set(range(len(LAYERS))), "every layer holds a module"


def test_an_arrow_up_would_be_found():
    assert arrows_up({"ampzoo.errors": ["ampzoo.engine.load"], "ampzoo.engine.load": ["ampzoo.errors"]}) == [
        "ampzoo.errors (core) imports ampzoo.engine.load (the engine)"]


def test_a_cycle_would_be_found():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]


def numeric_keys(schema=Config, prefix=""):
    for f in dataclasses.fields(schema):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from numeric_keys(type(default), f"{prefix}{f.name}.")
        elif f.type in ("int", "float", int, float, "Optional[int]", Optional[int]):
            yield f"{prefix}{f.name}"


def test_every_number_in_the_schema_has_a_range():
    keys = set(numeric_keys())
    assert len(keys) > 30
    assert keys == set(RANGES), f"without a range: {sorted(keys - set(RANGES))}; stale: {sorted(set(RANGES) - keys)}"


@pytest.mark.parametrize("key", sorted(RANGES))
def test_an_out_of_range_value_is_one_error_line(key, capsys):
    low, high = RANGES[key]
    bad = (low - 1 if not isinstance(low, float) else (0.0 if low == 0.0 else low - 1)) if low is not None else high + 1
    if key == "trainer.sink_size":
        bad = -2
    with pytest.raises(SystemExit) as e:
        check_command_line(["recipe=lenet_o2", f"{key}={bad}"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith(f"error: {key}=") and "\n" not in err, err
    if high is not None:
        with pytest.raises(SystemExit):
            check_command_line(["recipe=lenet_o2", f"{key}={high * 2 + 1}"])


def test_the_users_keys_win_over_the_smoke_block():
    cfg, note = load_config(["recipe=transformer_base_o2", "model.params.d_model=96", "trainer.epochs=3"])
    assert cfg.model.params.d_model == 96 and cfg.trainer.epochs == 3, "the user's values, not the smoke block's"
    assert cfg.model.params.heads == 4, "the smoke block's other keys still apply"
    assert "model.params.heads=4" in note and "your model.params.d_model, trainer.epochs kept" in note
    assert "trainer.epochs=" not in note.split("kept")[0].replace("your", "")


def test_a_combination_that_cannot_run_names_both(capsys):
    with pytest.raises(SystemExit):
        check_command_line(["recipe=transformer_base_o2", "model.params.d_model=90"])
    err = capsys.readouterr().err.strip()
    assert "d_model" in err and "heads" in err and "smoke block" in err and "\n" not in err, err


@pytest.mark.parametrize("start, spe, epochs, expected", [
    (0, 10, 3, [(0, 0, 3)]),
    (20, 10, 3, [(2, 0, 3)]),
    (25, 10, 3, [(2, 5, 3)]),
    (14, 10, 3, [(1, 4, 2), (2, 0, 3)]),
    (30, 10, 3, []),
])
def test_the_passes_of_a_resume(start, spe, epochs, expected):
    from train import passes
    assert passes(start, spe, epochs) == expected


def test_train_py_reads_like_a_recipe():
    """train.py is setup, train, evaluate, clean up: at most 350 lines and no function over 40; the process
    around it (command line, run directory, signals, error lines) is ampzoo.engine.process's."""
    text = (ROOT / "train.py").read_text()
    lengths = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef)}
    assert {"main", "setup", "train", "train_rung", "finish", "passes"} <= set(lengths)
    assert len(text.splitlines()) <= 350
    assert max(lengths.values()) <= 40, {name: n for name, n in lengths.items() if n > 40}


# Hydra's public API beyond `hydra.main`, `hydra.compose` and `hydra.initialize_config_dir`: HydraConfig and
# ConfigStore (documented), and the override parser (the API of Hydra's sweeper plugins)
PUBLIC_HYDRA_CORE = ("hydra.core.hydra_config", "hydra.core.config_store", "hydra.core.override_parser")


def habits_broken(source: str) -> list:
    """What a module does that the code does not: walk the stack (sys._getframe, a command takes the stop signals
    itself), use a private Hydra API (hydra._internal, another hydra.core module, a private name), or assign a
    lambda to a name (a def says what it is)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "_getframe":
            found.append(f"line {node.lineno}: sys._getframe")
        modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        for module in modules:
            hydra = module.split(".")[0] == "hydra"
            private = any(part.startswith("_") for part in module.split(".")) or (
                module.startswith("hydra.core") and not module.startswith(PUBLIC_HYDRA_CORE))
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            if hydra and (private or any(n.startswith("_") for n in names)):
                found.append(f"line {node.lineno}: private Hydra API {module}")
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda) and \
                any(isinstance(t, ast.Name) for t in node.targets):
            found.append(f"line {node.lineno}: a lambda assigned to a name")
    return found


def test_no_stack_walking_no_private_hydra_and_no_named_lambda():
    offenders = {str(path.relative_to(ROOT)): habits_broken(path.read_text()) for path in ROOT.rglob("*.py")
                 if ".venv" not in path.parts}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_a_broken_habit_would_be_found():
    source = ("import sys\nfrom hydra._internal.utils import get_args_parser\n"
              "from hydra.core.utils import run_job\nfrom hydra.core.hydra_config import HydraConfig\n"
              "frame = sys._getframe(1)\nsquare = lambda x: x * x\nkey = sorted([1], key=lambda x: -x)\n")
    assert sorted(habits_broken(source)) == ["line 2: private Hydra API hydra._internal.utils",
                                     "line 3: private Hydra API hydra.core.utils",
                                     "line 5: sys._getframe", "line 6: a lambda assigned to a name"]


def test_config_enums_are_plain_strings_to_omegaconf():
    """StrEnum: `str(cfg.amp.level)` is "O2" and compares equal to it, with no `.value` unwrapping."""
    cfg, _ = load_config(["recipe=lenet_o2", "amp.loss_scale.type=dynamic"])
    assert str(cfg.amp.level) == "O2" == cfg.amp.level and f"{cfg.amp.loss_scale.type}" == "dynamic"
    with pytest.raises(SystemExit):
        check_command_line(["recipe=lenet_o2", "amp.level=O5"])


def test_every_entry_point_loads_its_config_through_load_config():
    for script in ("train.py", "eval.py", "export.py", "amp/report/command.py", "amp/audit/command.py",
                   "bench/common.py"):
        text = (ROOT / script).read_text()
        # eval.py and export.py through ampzoo.engine.weights.checkpoint_config, which calls load_config
        assert ("load_config" in text or "checkpoint_config" in text) and "apply_smoke" not in text, script
    assert "load_config(argv)" in (ROOT / "ampzoo" / "engine" / "weights.py").read_text()


def test_only_the_entry_helper_sets_up_mindspore():
    """ampzoo.entry, which every command imports first, is the one place that quiets MindSpore, and build_model the
    one that caps oneDNN; importing any library module leaves the process as it was."""
    callers = sorted(name for name, path in project_modules().items()
                     for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("cap_onednn_isa",
                                                                                        "quiet_mindspore"))
    assert callers == ["ampzoo.engine.network", "ampzoo.entry"]
    libraries = [m for m in project_modules() if m.split(".")[0] in ("ampzoo", "amp", "models")
                 and m != "ampzoo.entry" and not m.endswith("__main__")]
    code = ("import os, importlib\n"
            f"for m in {libraries!r}:\n    importlib.import_module(m)\n"
            "print(os.environ.get('ONEDNN_MAX_CPU_ISA'), os.environ.get('GLOG_v'))")
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "GLOG_v")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["None", "None"]


def is_main_block(node) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and getattr(node.test.left, "id", "") == "__name__"
            and getattr(node.test.comparators[0], "value", "") == "__main__")


def test_every_command_starts_like_one():
    """Every module with `if __name__ == "__main__":` (the root scripts, bench/, bench/lab/, amp/*/__main__.py)
    imports ampzoo.entry before anything else (its import is the start-up: MindSpore's C++ logs off, a stop signal
    one line and 128 + N) and ends with run(main) (a ConfigError one `error:` line, exit 2; -h the docstring of
    main's module). train.py
    alone is Hydra's: @hydra.main reads the command line, and its main catches what run(main) would."""
    paths = [*ROOT.glob("*.py"), *(p for d in ("bench", "bench/lab") for p in (ROOT / d).glob("*.py")),
             *ROOT.glob("amp/*/__main__.py")]
    commands, wrong = [], []
    for path in paths:
        body = ast.parse(path.read_text()).body
        block = next((node for node in body if is_main_block(node)), None)
        if block is None:
            continue
        name = str(path.relative_to(ROOT))
        commands.append(name)
        first = next(node for node in body if isinstance(node, (ast.Import, ast.ImportFrom)))
        if not (getattr(first, "module", None) == "ampzoo.entry"
                or [a.name for a in getattr(first, "names", [])] == ["ampzoo.entry"] and isinstance(first, ast.Import)):
            wrong.append(f"{name}: first import is not ampzoo.entry")
        if name != "train.py" and [ast.unparse(node) for node in block.body] not in (["run(main)"],
                                                                                     ["ampzoo.entry.run(main)"]):
            wrong.append(f"{name}: the __main__ block is not run(main)")
    assert wrong == []
    assert {"train.py", "eval.py", "export.py", "doctor.py", "bench/reproduce.py", "bench/run.py",
            "bench/lab/torch_multi30k.py", "amp/report/__main__.py", "amp/audit/__main__.py",
            "amp/search/__main__.py"} <= set(commands)


def schema_keys(schema=Config, prefix=""):
    for f in dataclasses.fields(schema):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from schema_keys(type(default), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_the_configuration_doc_names_every_key():
    """docs/configuration.md's table: a key by its full name, or by its name in its group's row."""
    rows = [line for line in (ROOT / "docs" / "configuration.md").read_text().splitlines() if line.startswith("| `")]

    def named(key):
        group, _, leaf = key.rpartition(".")
        return any(f"`{key}`" in row or (group and row.split("|")[1].count(f"`{group}.") and f"`{leaf}`" in row)
                   for row in rows)
    assert [k for k in schema_keys() if not named(k)] == []


def _anchors(text: str) -> set:
    """The #anchors GitHub gives a Markdown file's headings: lowercased, punctuation dropped, spaces to hyphens,
    a repeated one numbered."""
    import re
    seen, out = {}, set()
    for heading in re.findall(r"^#+\s+(.+?)\s*$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", re.sub(r"`|\*\*|\[([^]]*)\]\([^)]*\)", r"\1", heading).lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_link_in_the_docs_leads_somewhere():
    """A relative link in a tracked Markdown file (README, docs/, recipes/, bench/lab/, bench/ results) names a file or
    folder of the repository, relative to the file the link is in: the one a reader's click opens; and its
    #anchor, if any, a heading of that file (in recipe cards too: `docs/x.md#anchor` in a comment)."""
    import re
    import subprocess
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    tracked = set(files) | {str(parent) for f in files for parent in Path(f).parents}  # files and their folders

    def leads(name, target):
        path = os.path.normpath(os.path.join(os.path.dirname(name), target))
        return path in tracked or path == "."
    links = [(name, target, anchor) for name in files if name.endswith(".md")
             for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", (ROOT / name).read_text())
             if not target.startswith(("http:", "https:", "mailto:"))]
    broken = [f"{name}: {target}" for name, target, _ in links if target and not leads(name, target)]
    assert broken == [], "a link to a file that is not in the repository"
    cards = [(name, target, anchor) for name in files if name.startswith(("recipes/", "conf/card/"))
             and name.endswith(".yaml")
             for target, anchor in re.findall(r"(docs/[\w.-]+\.md)#([\w-]+)", (ROOT / name).read_text())]
    anchored = [(name, os.path.normpath(os.path.join(os.path.dirname(name), target)) if target else name, anchor)
                for name, target, anchor in links if anchor] + cards
    headings = {path: _anchors((ROOT / path).read_text()) for path in {p for _, p, _ in anchored}
                if path.endswith(".md") and (ROOT / path).is_file()}
    lost = [f"{name}: {path}#{anchor}" for name, path, anchor in anchored
            if path in headings and anchor not in headings[path]]
    assert lost == [], "a link to a heading that the file does not have"


def test_no_import_waits_for_a_start_up_trick():
    """No E402 exemption anywhere: a command imports what it needs at the top, ampzoo.entry first (its import is the
    start-up), and nothing has to run between imports."""
    marker = "noqa: " + "E402"  # spelled apart so this file does not hold it
    offenders = [str(path.relative_to(ROOT)) for path in ROOT.rglob("*.py")
                 if ".venv" not in path.parts and marker in path.read_text()]
    assert offenders == []


def test_the_cpu_kernels_live_outside_the_models():
    """The C++ of the CPU kernels is an extension of its own (cpu_kernels/), not part of the model zoo, and the
    build compiles every source it holds."""
    from cpu_kernels import SOURCES
    assert not [p.name for p in (ROOT / "models").rglob("*") if p.suffix in (".cc", ".cpp", ".h", ".hpp")]
    sources = sorted(p.name for p in (ROOT / "cpu_kernels" / "csrc").glob("*.cc"))
    assert sources == sorted(p.name for p in SOURCES) and "conv.cc" in sources and "runtime.cc" in sources
    assert not list((ROOT / "cpu_kernels").glob("*.cc"))


def test_the_cpu_kernels_share_headers_not_copied_prototypes():
    """What the op files share is declared once, in csrc/runtime.h (runtime.cc defines it), and every AOT entry
    point is written with aot.h's macro: no op file declares a function of another, and none spells out the
    entry signature."""
    import re
    csrc = ROOT / "cpu_kernels" / "csrc"
    runtime_h = (csrc / "runtime.h").read_text()
    for path in sorted(csrc.glob("*.cc")):
        text = path.read_text()
        declared = re.findall(r'^(?:extern "C" )?[\w:]+[ *&]+AmpZoo\w+\([^;{]*\);', text, re.M)
        assert declared == [], (path.name, declared)
        assert '#include "runtime.h"' in text, path.name
        assert "void **params, int *ndims, int64_t **shapes, const char **dtypes, void *" not in text, path.name
    for name in re.findall(r"\b(AmpZoo\w+)\(", runtime_h):
        assert re.search(rf"\b{name}\([^;]*\) *\{{", " ".join((csrc / f).read_text() for f in
                         ("runtime.cc", "omp_weights.cc"))), f"{name} is declared in runtime.h but not defined"


def test_the_code_passes_the_linter():
    """ruff check, with the rules pyproject.toml selects, finds nothing: no unused name, no undefined one, no line
    over 120, no closure that captures a loop variable, no `except Exception` without a noqa saying why."""
    ruff = Path(sys.executable).parent / "ruff"
    if not ruff.is_file():
        pytest.skip("ruff is not installed: pip install -r requirements-test.txt")
    out = subprocess.run([str(ruff), "check", "--no-cache", "--output-format", "concise", str(ROOT)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_labs_tests_are_outside_make_test():
    """The lab is not the product: `make test` (pytest with pyproject's default marks) collects none of the lab's
    tests; `make test-lab` runs them."""
    def collected(*marks):
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", *marks,
                              "tests/test_lab.py"], cwd=ROOT, capture_output=True, text=True)
        return [line for line in out.stdout.splitlines() if "::" in line]
    assert collected() == []
    assert len(collected("-m", "lab")) >= 3


def test_a_recipe_cards_header_is_written_once():
    """The levels of one recipe family (lenet_o0/o2/o3, ...) share their card (conf/card/FAMILY.yaml: model,
    data, schedule, the published number and its source), through Hydra's defaults: no comment line of a card is
    copied into two recipes. resnet34_o0/o2/o3 cite three different published schedules (issue 62, item 7):
    their card comes once their schedules are settled."""
    lines = {}
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        for line in path.read_text().splitlines():
            text = line.strip()
            if text.startswith("#") and len(text) > 50 and "conf/card/" not in text and "train.py" not in text:
                lines.setdefault(text, set()).add(path.stem)
    copied = {text: sorted(names) for text, names in lines.items() if len(names) > 1
              and not all(name.startswith("resnet34_") for name in names)}
    assert copied == {}
    cards = sorted(p.stem for p in (ROOT / "conf" / "card").glob("*.yaml"))
    assert {"lenet", "lenet_fashion", "resnet18_fashion", "transformer_base", "transformer_tiny_multi30k"} <= set(cards)
    for card in cards:
        users = [p.stem for p in (ROOT / "recipes").glob("*.yaml") if f"- /card/{card}\n" in p.read_text()]
        assert len(users) >= 2, f"conf/card/{card}.yaml is the card of {users}: a card is for a family"


def test_the_moved_modules_find_the_checkout():
    """A module that finds the checkout from its own file (the recipes, train.py, the shipped weights) names the
    repository root, at whatever depth it sits in its package."""
    import ampzoo.config
    import ampzoo.models as models
    from ampzoo.engine import train_run, weights
    assert ampzoo.config.ROOT == train_run.ROOT == models.ROOT == ROOT
    assert weights.WEIGHTS == ROOT / "weights" and (ROOT / "train.py").is_file()


def test_the_readme_is_a_guide_of_at_most_350_lines():
    """The README guides a user (issue 78): measurements live in docs/benchmarks.md, and it stays readable in one
    sitting."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 350, len(lines)
