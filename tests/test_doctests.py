"""Every public module's docstring examples run (``>>>`` lines), so the examples users copy stay true.

Examples that need a cluster or a multi-rank launch carry ``# doctest: +SKIP``; everything else runs here
in one process. Every public module (no leading underscore in its name) that defines public functions or
classes must carry at least one example; packages that only re-export need none.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import pytest

import rlkit

# entry points and glue, with nothing a user calls from Python
NO_EXAMPLE_NEEDED = {"rlkit.cli", "rlkit.demo", "rlkit.parallel.check", "rlkit.backends.megatron.check",
                     "rlkit.backends.deepspeed_check"}


def defines_public_objects(mod) -> bool:
    return any(not n.startswith("_") and (inspect.isfunction(o) or inspect.isclass(o))
               and o.__module__ == mod.__name__ for n, o in vars(mod).items())


def public_modules() -> list[str]:
    names = ["rlkit"]
    for info in pkgutil.walk_packages(rlkit.__path__, prefix="rlkit."):
        if not any(part.startswith("_") and part != "__main__" for part in info.name.split(".")):
            names.append(info.name)
    return sorted(n for n in names if not n.endswith("__main__"))


@pytest.mark.parametrize("name", public_modules())
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    mod = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = [t for t in finder.find(mod, name) if t.examples]
    if name not in NO_EXAMPLE_NEEDED and defines_public_objects(mod):
        assert tests, f"{name} has no docstring example: add a runnable '>>>' example to its public objects"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for t in tests:
        runner.run(t)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed (output above)"
