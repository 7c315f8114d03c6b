"""The project's layout, checked from its source (no run): imports point down, never round in a circle (imports inside
functions included); a library module imports no step script; no code line over 120 characters; no lambda given a
name; train_gpt2.py and its main() within their lengths."""
import ast
import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_files(*patterns):
    return sorted(os.path.relpath(f, ROOT) for pattern in patterns for f in glob.glob(os.path.join(ROOT, pattern)))


def module_name(path):  # compute/cpu.py -> compute.cpu; parallel/__init__.py -> parallel
    return path[:-3].replace(os.sep, ".").removesuffix(".__init__")


def parse(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return ast.parse(f.read(), path)


def imports(path, known):
    """(module imported, line, whether inside a function) for each project module that `path` imports."""
    me = module_name(path)
    package = me if path.endswith("__init__.py") else me.rpartition(".")[0]
    tree = parse(path)
    in_function = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for node in ast.walk(fn)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x; from .sizes import y
                base = ".".join(filter(None, [package.rsplit(".", node.level - 1)[0], base]))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name in known and name != me:
                found.append((name, node.lineno, id(node) in in_function))
    return found


def project_modules():
    """{module name: path} for the project's own code (steps, libraries, packages; not tests or bench)."""
    return {module_name(p): p for p in python_files("*.py", "*/*.py") if not p.startswith(("tests", "bench"))}


def step_scripts(modules):
    """The step scripts: the top-level files a user runs (they have a __main__ block)."""
    steps = set()
    for name, path in modules.items():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            if "." not in name and '__name__ == "__main__"' in f.read():
                steps.add(name)
    return steps


def find_circle(edges):
    """One import circle as a list of modules (first == last), or None. Depth-first search, colouring the nodes."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (circle := visit(nxt)):
                return circle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (circle := visit(node)):
            return circle
    return None


def test_find_circle_finds_one():  # the checker itself: a circle through three modules is found, a chain is not
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("level", ["module", "package"])
def test_no_import_circle(level):
    """No module reaches itself through imports, lazy ones included; nor does a package (parallel/ -> plumbing/ ->
    parallel/ would be a circle between packages even with no circle between modules)."""
    modules = project_modules()

    def top(name):  # parallel.pipeline is the package parallel, or itself
        return name.split(".")[0] if level == "package" else name

    edges = {}
    for name, path in modules.items():
        for imported, _, _ in imports(path, modules):
            if top(imported) != top(name):
                edges.setdefault(top(name), set()).add(top(imported))
    assert find_circle(edges) is None, f"import circle: {' -> '.join(find_circle(edges))}"


def test_libraries_import_no_step():
    """A library module imports no step script; a step imports another only inside a function, and only train_gpt2
    (for its model) or, from train_gpt2, the evaluations it runs during training."""
    modules = project_modules()
    steps = step_scripts(modules)
    assert {"train_gpt2", "fineweb", "finetune", "hellaswag", "sample", "answer"} <= steps
    wrong = []
    for name, path in modules.items():
        for imported, line, lazy in imports(path, modules):
            if imported not in steps:
                continue
            if name not in steps:
                wrong.append(f"{path}:{line}: the library imports the step {imported}")
            elif not lazy:
                wrong.append(f"{path}:{line}: a step imports the step {imported} at its top")
            elif imported != "train_gpt2" and name != "train_gpt2":
                wrong.append(f"{path}:{line}: imports the step {imported} (only train_gpt2 may be)")
    assert not wrong, "\n".join(wrong)


def test_no_packed_lines_and_no_named_lambdas():
    long_lines, named_lambdas = [], []
    for path in python_files("*.py", "*/*.py", "*/*/*.py"):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if len(line.rstrip("\n")) > 120:
                    long_lines.append(f"{path}:{number}: {len(line.rstrip())} characters")
        for node in ast.walk(parse(path)):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            named = any(isinstance(target, (ast.Name, ast.Attribute)) for target in targets)
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Lambda) and named:
                named_lambdas.append(f"{path}:{node.lineno}")
    assert not long_lines, "lines over 120 characters:\n" + "\n".join(long_lines)
    assert not named_lambdas, "a lambda given a name (write a def):\n" + "\n".join(named_lambdas)


def test_trainer_reads_in_one_sitting():
    with open(os.path.join(ROOT, "train_gpt2.py"), encoding="utf-8") as f:
        assert sum(1 for _ in f) <= 800
    main = next(node for node in parse("train_gpt2.py").body if isinstance(node, ast.FunctionDef)
                and node.name == "main")
    assert main.end_lineno - main.lineno + 1 <= 65
