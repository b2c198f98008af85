"""Every relative link of README.md and of the markdown pages under docs/ (docs/lab included) points to a file
or folder of the tree: `[text](path)`, `[text](path#anchor)`, `[text](<path>)`, `[ref]: path` and `<img src="path">`; URLs
(scheme://, mailto:) and in-page anchors (#...) are not files and are skipped."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*(\S+)|<img[^>]*\ssrc=\"([^\"]+)\"",
                  re.MULTILINE)


def relative_links(text: str) -> list:
    """The relative link targets of markdown `text`, in order, without their #anchor or ?query; URLs, mailto:
    and in-page anchors left out."""
    out = []
    for m in LINK.finditer(text):
        target = next(g for g in m.groups() if g is not None)
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        target = re.split(r"[#?]", target, maxsplit=1)[0]
        if target:
            out.append(target)
    return out


def _pages():
    pages = [os.path.join(ROOT, "README.md")]
    for root, _, files in os.walk(os.path.join(ROOT, "docs")):
        pages += [os.path.join(root, f) for f in sorted(files) if f.endswith(".md")]
    return pages


def test_relative_links_finds_every_form():
    text = ('see [a](docs/a.md), [b](b.md#x "t"), [c](https://x.org/y.md), [d](#here), [e](<e.md>)\n'
            '[ref]: ../lab/r.json\n<img src="img/p.png" width=3>\n[m](mailto:a@b)')
    assert relative_links(text) == ["docs/a.md", "b.md", "e.md", "../lab/r.json", "img/p.png"]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page):
    with open(page, encoding="utf-8") as f:
        text = f.read()
    here = os.path.dirname(page)
    broken = [t for t in relative_links(text) if not os.path.exists(os.path.normpath(os.path.join(here, t)))]
    assert not broken, f"{os.path.relpath(page, ROOT)}: links to missing files: {broken}"
