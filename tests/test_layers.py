"""The package's layers, read from its imports: no module of ``caper_jax`` imports from a layer above its own,
and its packages import each other without a cycle.

Every ``import`` statement counts, at module top or inside a function (a deferred import is still a
dependency). The layers are declared once, here, lowest first; a module may import its own package and the
packages of the layers below it, never a sibling of its own layer nor anything above.
"""
import ast
import pathlib

from tests.helpers import REPO

LAYERS: tuple[tuple[str, ...], ...] = (
    ("utils", "sql", "ops", "parallel", "settings"),   # import nothing of caper_jax: errors, files, optimiser;
                                           # the SQL side (no JAX); kernels; mesh, logical sharding rules, host I/O,
                                           # memory report; a config turned into frozen dataclasses
    ("demo", "models", "checkpoint"),      # the miniature SQL world; the Qwen3.5 backbone; orbax save and restore
    ("data", "runs"),                      # datasets, tokenisers, batches; a saved run read back
    ("sections",),                         # the settings sections every trainer shares (model, optim, world)
    ("loop",),                             # one live training run: mesh, model, optimiser, data, checkpoints
    ("policy",),                           # prompts, sampling, rollouts, log-probs of a causal LM
    ("prm", "sft"),                        # the Clause-PRM and its trainer; supervised fine-tuning
    ("rl", "eval"),                        # GRPO and its dry run; evaluation of policies and verifiers
    ("experiments",),                      # the miniature and the Spider verifier, end to end
    ("train", "annotate", "evaluate", "verify", "convert", "upgrade_run"),   # the command lines
)


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    """``caper_jax/rl/step.py`` -> ``caper_jax.rl.step``; a package's ``__init__.py`` names the package."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path, root: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of the package ``root`` names in ``path``, at any depth.

    ``from caper_jax.rl import rewards`` names the module ``caper_jax.rl.rewards`` where that file exists, and
    the package ``caper_jax.rl`` where ``rewards`` is a name defined in it; relative imports are resolved.
    """
    this = module_name(path, root)
    base = this.split(".") if path.name == "__init__.py" else this.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = ".".join(base[: len(base) - node.level + 1] + ([module] if module else []))
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                relative = pathlib.Path(*submodule.split(".")[1:])
                is_module = (root / relative).with_suffix(".py").exists() or (root / relative / "__init__.py").exists()
                found.append((node.lineno, submodule if is_module else module))
    return list(dict.fromkeys((line, module) for line, module in found if module.split(".")[0] == root.name))


def package_of(module: str) -> str | None:
    """``caper_jax.rl.step`` -> ``rl``; ``caper_jax.loop`` -> ``loop``; the root package itself -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def import_edges(root: pathlib.Path) -> list[tuple[str, int, str, str, str]]:
    """``(file, line, imported module, from package, to package)`` of every import between two packages."""
    edges = []
    for path in sorted(root.rglob("*.py")):
        source = package_of(module_name(path, root))
        for line, module in imported_modules(path, root):
            target = package_of(module)
            if source and target and target != source:
                edges.append((str(path.relative_to(root.parent)), line, module, source, target))
    return edges


def layer_index(layers) -> dict[str, int]:
    return {package: depth for depth, layer in enumerate(layers) for package in layer}


def upward_imports(edges, layers) -> list[str]:
    """One line per import into the same layer or a higher one, ``file:line imports module (from -> to)``."""
    depth = layer_index(layers)
    return [f"{file}:{line} imports {module} ({source}, layer {depth[source]} -> {target}, layer {depth[target]})"
            for file, line, module, source, target in edges if depth[target] >= depth[source]]


def package_cycle(edges) -> list[str]:
    """One cycle of the package graph as ``[a, b, ..., a]``, or [] when the graph has none."""
    graph: dict[str, set[str]] = {}
    for *_, source, target in edges:
        graph.setdefault(source, set()).add(target)
    state: dict[str, str] = {}   # "open" while on the depth-first path, "done" once all it reaches is explored

    def visit(package, path):
        state[package] = "open"
        for target in sorted(graph.get(package, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target, path + [target])):
                return cycle
        state[package] = "done"
        return []

    for package in sorted(graph):
        if package not in state and (cycle := visit(package, [package])):
            return cycle
    return []


def packages_of(root: pathlib.Path) -> set[str]:
    """The sub-packages and top-level modules of ``root`` (its ``__init__.py`` aside)."""
    return ({p.name for p in root.iterdir() if (p / "__init__.py").exists()}
            | {p.stem for p in root.glob("*.py") if p.name != "__init__.py"})


def test_every_package_has_one_layer():
    """A new package or module at the top of ``caper_jax/`` must be placed in LAYERS before it is checked."""
    declared = [package for layer in LAYERS for package in layer]
    assert len(declared) == len(set(declared)), "a package is declared in two layers"
    assert packages_of(REPO / "caper_jax") == set(declared)


def test_no_import_runs_up_a_layer():
    edges = import_edges(REPO / "caper_jax")
    assert len(edges) > 100   # the scan reads the package (it holds a few hundred cross-package imports)
    upward = upward_imports(edges, LAYERS)
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_the_packages_form_no_cycle():
    cycle = package_cycle(import_edges(REPO / "caper_jax"))
    assert not cycle, "package cycle: " + " -> ".join(cycle)


def test_the_checker_finds_upward_and_local_imports_and_cycles(tmp_path):
    """On a three-package tree the checker reports an upward import made inside a function, a relative one
    and a sibling one, with their lines, and the cycle they close; with them gone it reports nothing."""
    root = tmp_path / "pkg"
    for package in ("low", "mid", "high"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "top.py").write_text("from pkg.high import api\n")
    (root / "side.py").write_text("X = 1\n")
    (root / "high" / "api.py").write_text("import os\nfrom pkg.mid import core\nfrom pkg import low\n")
    (root / "mid" / "core.py").write_text("from ..low import base\n")
    (root / "low" / "base.py").write_text("import pkg.side\n\ndef late():\n    from pkg.high.api import X\n")
    layers = (("low",), ("mid",), ("high", "side"), ("top",))

    edges = import_edges(root)
    assert {(source, target) for *_, source, target in edges} == {
        ("top", "high"), ("high", "mid"), ("high", "low"), ("mid", "low"), ("low", "side"), ("low", "high")}
    assert upward_imports(edges, layers) == [
        "pkg/low/base.py:1 imports pkg.side (low, layer 0 -> side, layer 2)",
        "pkg/low/base.py:4 imports pkg.high.api (low, layer 0 -> high, layer 2)"]
    assert package_cycle(edges) == ["high", "low", "high"]
    assert upward_imports(edges, (("low", "mid"), ("high", "side"), ("top",))) == [   # siblings of one layer
        "pkg/low/base.py:1 imports pkg.side (low, layer 0 -> side, layer 1)",
        "pkg/low/base.py:4 imports pkg.high.api (low, layer 0 -> high, layer 1)",
        "pkg/mid/core.py:1 imports pkg.low.base (mid, layer 0 -> low, layer 0)"]

    (root / "low" / "base.py").write_text("def late():\n    return 1\n")
    edges = import_edges(root)
    assert upward_imports(edges, layers) == [] and package_cycle(edges) == []
    assert packages_of(root) == {"low", "mid", "high", "top", "side"}
