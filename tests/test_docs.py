"""The documentation: a short README whose links resolve, a site that builds with no broken
link, and a configuration reference generated from the schema (never edited by hand)."""

import re
import subprocess
import sys
from pathlib import Path

from tierstack import config_reference

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_is_read_in_ten_minutes():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_every_relative_link_of_the_readme_names_a_file_in_the_clone():
    text = (ROOT / "README.md").read_text()
    links = [l for l in re.findall(r"\]\(([^)]+)\)", text) if not l.startswith(("http", "#"))]
    assert links, "the README links its guides"
    missing = [l for l in links if not (ROOT / l.split("#")[0]).exists()]
    assert not missing, f"README links to files a clone lacks: {missing}"


def test_the_documentation_site_builds_with_no_broken_link(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                          "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").exists()


def test_the_configuration_reference_is_the_schemas_own_output():
    committed = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    assert committed == config_reference.render(), (
        "docs/reference/configuration.md is out of date with tierstack/config.py: run "
        "`make docs-reference`")


def test_every_key_of_every_section_says_what_it_does():
    """A new config field without its docstring fails here: the reference would have an
    empty row."""
    import dataclasses
    import typing

    from tierstack.config import TierstackConfig

    undocumented = []
    for name, cls in config_reference._sections(TierstackConfig, ""):
        docs, hints = config_reference._field_docs(cls), typing.get_type_hints(cls)
        undocumented += [f"{name}.{f.name}".lstrip(".") for f in dataclasses.fields(cls)
                         if not dataclasses.is_dataclass(hints[f.name]) and not docs.get(f.name)]
    assert not undocumented, f"config fields with no docstring in tierstack/config.py: {undocumented}"


def test_the_layout_page_names_every_module_as_its_docstring_says():
    """docs/architecture/layout.md is generated from the modules (every code module named,
    with its docstring's first sentence): a module added or moved without `make docs-layout`
    fails here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "generate_layout", ROOT / "docs" / "architecture" / "generate_layout.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    committed = (ROOT / "docs" / "architecture" / "layout.md").read_text()
    assert committed == generator.render(), "docs/architecture/layout.md is out of date: run `make docs-layout`"
    for _, directory in generator._packages():
        for module in directory.glob("*.py"):
            if module.name != "__init__.py" and not module.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                assert f"  {module.name} " in committed, module
