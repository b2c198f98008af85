"""The library reads no environment variable (issue 21: configuration is data): every read of the process
environment in `megatron_splitkv/` (os.environ, os.getenv, their bytes and write forms, names imported from
os) is found by parsing the package's source, and any read fails."""

import ast
import os

import megatron_splitkv

PACKAGE = os.path.dirname(os.path.abspath(megatron_splitkv.__file__))
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}

def environment_reads(source: str, filename: str = "<source>"):
    """[(enclosing function qualname or '<module>', line, what)] for every environment access in `source`:
    an attribute named like os's environment API (os.environ, os.getenv, ...) and `from os import environ`."""
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope != "<module>" else child.name
            if isinstance(child, ast.Attribute) and child.attr in ENV_NAMES:
                found.append((scope, child.lineno, f".{child.attr}"))
            if isinstance(child, ast.ImportFrom) and child.module == "os":
                found.extend((scope, child.lineno, f"from os import {a.name}")
                             for a in child.names if a.name in ENV_NAMES or a.name == "*")
            visit(child, inner)

    visit(ast.parse(source, filename), "<module>")
    return found


def _package_reads():
    reads = {}
    for root, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
                with open(path, encoding="utf-8") as f:
                    for scope, line, what in environment_reads(f.read(), path):
                        reads.setdefault((rel, scope), []).append(f"{rel}:{line} {what} in {scope}")
    return reads


def test_finder_sees_every_form():
    src = ("import os\nfrom os import getenv as g\nX = os.environ.get('A')\n"
           "class C:\n    def f(self):\n        return os.getenv('B'), os.environb\n")
    got = environment_reads(src)
    assert [(s, w) for s, _, w in got] == [("<module>", "from os import getenv"), ("<module>", ".environ"),
                                           ("C.f", ".getenv"), ("C.f", ".environb")]
    assert environment_reads("import os\npath = os.path.join('a', 'b')\nenv = {'environ': 1}\n") == []


def test_library_reads_no_environment_variable():
    """No read at all (the launcher's processes per node reach `validate_splitkv_args` as its `launcher_env`
    argument, picked by the entry script from its own os.environ)."""
    reads = [line for _, lines in sorted(_package_reads().items()) for line in lines]
    assert not reads, "environment reads in the library (make them arguments or config fields):\n" + "\n".join(reads)
