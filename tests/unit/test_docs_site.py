"""The documentation site's generated pages (``docs/_hooks/site.py``): the backend support
matrix has one row per registered backend, read from its declared capabilities, and the
home page is the README with its ``docs/`` links made site-relative. CI builds the whole
site with ``mkdocs build --strict``."""

from __future__ import annotations

import importlib.util
import os

from epmoe.comm import backend_class, backend_names

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _hooks():
    path = os.path.join(ROOT, "docs", "_hooks", "site.py")
    spec = importlib.util.spec_from_file_location("epmoe_site_hooks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_matrix_has_a_row_per_registered_backend():
    table = _hooks().backends_matrix().splitlines()
    rows = {line.split("|")[1].strip(" `"): line for line in table[2:]}
    assert sorted(rows) == sorted(backend_names())
    for name, line in rows.items():
        caps = backend_class(name).capabilities
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[4] == ("yes" if caps.graph_safe else "no"), (name, cells)
        assert cells[9] == ("yes" if caps.auto else "no"), (name, cells)
        assert all(layout.value in cells[1] for layout in caps.layouts), (name, cells)


def test_the_home_page_is_the_readme_with_site_links():
    page = _hooks().home_page()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert page.splitlines()[0] == readme.splitlines()[0]
    assert "](docs/" not in page
    assert len(page) > 0.9 * len(readme)
