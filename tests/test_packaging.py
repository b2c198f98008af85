"""setup.py's extras and requirements.txt agree, each extra is pinned or ranged (a URL for apex), and README's
install section names every extra (before: `data`, `hypergraph`, `flash-attn` and `dev` unpinned while
requirements.txt pinned some of them, and the install section named only `megatron` and `data`)."""

import os
import re
import runpy
from unittest import mock

from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_kwargs():
    with mock.patch("setuptools.setup") as setup:
        runpy.run_path(os.path.join(ROOT, "setup.py"))
    return setup.call_args.kwargs


def test_every_extra_is_pinned_or_ranged():
    extras = _setup_kwargs()["extras_require"]
    assert {"megatron", "te", "flash-attn", "apex", "hypergraph", "data", "dev"} <= set(extras)
    for name, reqs in extras.items():
        for text in reqs:
            r = Requirement(text)
            assert r.url or str(r.specifier), f"extra {name!r}: {text!r} has no version"
            # a range has both ends (an open-ended >= would take any future major version)
            ops = sorted(s.operator for s in r.specifier)
            assert r.url or ops == ["=="] or ops == ["<", ">="], f"extra {name!r}: {text!r}"


def test_requirements_txt_pins_equal_setup_py():
    kw = _setup_kwargs()
    setup_reqs = {Requirement(t).name: Requirement(t) for reqs in [kw["install_requires"], *kw["extras_require"].values()]
                  for t in reqs}
    lines = [ln.split("#")[0].strip() for ln in open(os.path.join(ROOT, "requirements.txt"))]
    for line in filter(None, lines):
        r = Requirement(line)
        assert r.name in setup_reqs, f"requirements.txt: {r.name} is in no setup.py requirement"
        assert r.specifier == setup_reqs[r.name].specifier, (line, str(setup_reqs[r.name]))


def test_readme_install_section_names_every_extra():
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("## Set up and run", 1)[1].split("\n## ", 1)[0]
    for name in _setup_kwargs()["extras_require"]:
        assert re.search(rf"`{re.escape(name)}`\s*\(", section), f"README install section: extra {name!r}"
    usage = open(os.path.join(ROOT, "docs", "usage.md")).read()
    for name in _setup_kwargs()["extras_require"]:  # and what each is for, one line each in docs/usage.md
        assert re.search(rf"^- `{re.escape(name)}`: ", usage, re.M), f"docs/usage.md extras: extra {name!r}"
