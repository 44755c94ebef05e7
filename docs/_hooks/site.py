"""mkdocs hooks of the epmoe site: pages that are generated so that they cannot drift.

* ``index.md``: the README (the one place the quick start is written), links into
  ``docs/`` rewritten for the site;
* ``backends.md``: the marker ``<!-- epmoe:backends -->`` becomes the support matrix, read
  from each registered backend's declared ``Capabilities``.
"""

from __future__ import annotations

import os
import re

MARKER = "<!-- epmoe:backends -->"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def backends_matrix() -> str:
    """The support matrix of every registered backend, one row each, from its class."""
    from epmoe.comm import backend_class, backend_names

    def yes(flag: bool) -> str:
        return "yes" if flag else "no"

    header = (
        "| backend | layouts | dtypes | devices | graph safe | FP8 dispatch | in flight | "
        "fixed M_max (default) | multi-node | picked by `auto` | ids of -1 |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for name in backend_names():
        caps = backend_class(name).capabilities
        dtypes = ", ".join(sorted(str(d).removeprefix("torch.") for d in caps.dtypes))
        fp8 = yes(caps.fp8_dispatch)
        if caps.fp8_dispatch and not caps.fp8_reference_quantizer:
            fp8 += " (its own quantizer)"
        empty = (
            "sent to an unused expert, weight 0"
            if caps.empty_entries_to_unused_expert
            else "not sent"
        )
        rows.append(
            f"| `{name}` | {', '.join(sorted(x.value for x in caps.layouts))} | {dtypes} | "
            f"{', '.join(sorted(caps.device_types))} | {yes(caps.graph_safe)} | "
            f"{fp8} | {caps.max_in_flight or 'any'} | "
            f"{caps.default_max_tokens or 'no (per call)'} | {yes(caps.multi_node)} | "
            f"{yes(caps.auto)} | {empty} |"
        )
    return header + "\n".join(rows) + "\n"


def home_page() -> str:
    """The README with its ``docs/x.md`` links pointing at the site's pages."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    text = re.sub(r"\]\(docs/([^)]+)\)", r"](\1)", text)
    # links to files outside docs/ go to the repository path as code
    return re.sub(r"\]\((?!https?://|#)([^)]+\.(?:py|sh|toml|yml))\)", r"] (`\1`)", text)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs hook)
    if page.file.src_uri == "index.md":
        return home_page()
    if MARKER in markdown:
        return markdown.replace(MARKER, backends_matrix())
    return markdown
