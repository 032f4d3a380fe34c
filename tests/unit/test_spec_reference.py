"""docs/spec-reference.md is the schema's own description, and experiments/TEMPLATE.yaml a spec with
every key at its default: both fail here when StudySpec changes and they do not."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from scalestudy.spec import reference
from scalestudy.spec.load import load_spec
from scalestudy.spec.study import StudySpec

REPO = Path(__file__).parents[2]
PAGE = REPO / "docs" / "spec-reference.md"
TEMPLATE = REPO / "experiments" / "TEMPLATE.yaml"
# What a user must choose: the template gives an example of each, not a default.
REQUIRED_EXAMPLES = {"name", "model", "hardware"}


def test_reference_page_is_regenerated():
    assert PAGE.read_text() == reference.render(), (
        f"docs/spec-reference.md is stale: run `{reference.REGENERATE}` (from the repo root, "
        "with .venv/bin/python) and commit the result")


def test_every_spec_key_has_a_description():
    assert reference.undescribed() == [], (
        "spec keys without a description; add Field(description=...) in spec/ or a line to "
        "DESCRIPTIONS in platform/scalestudy/spec/reference.py")


def test_every_validator_constraint_is_stated():
    assert reference.unexplained_validators() == [], (
        "validators whose constraint the reference cannot state; add them to _VALIDATOR_TEXT in "
        "platform/scalestudy/spec/reference.py")


def test_reference_walks_every_nested_section():
    paths = [s.path for s in reference.sections()]
    assert paths[0] == ""
    assert {"steps", "search", "tracking", "fault_tolerance", "elastic", "workers", "model",
            "model.dims"} <= set(paths)
    # a hardware profile is a catalogue entry or a file, never keys written in a spec
    assert not any(p.startswith("hardware") for p in paths)


def test_types_and_defaults_as_a_spec_writer_reads_them():
    fields = StudySpec.model_fields
    assert reference.key_type("seq_len", "seq_len", fields["seq_len"]) == (
        "int > 0; or a list of these (swept)")
    assert reference.default_text("world_size", "world_size", fields["world_size"]) == "`1`"
    assert reference.default_text("global_batch", "global_batch",
                                  fields["global_batch"]) == "`null`"
    assert reference.default_text("workers", "workers", fields["workers"]) == "`{reuse: true}`"
    assert reference.default_text("name", "name", fields["name"]) == "required"
    assert "`bf16`" in reference.key_type("precision", "precision", fields["precision"])
    assert reference.key_type("elastic", "elastic", fields["elastic"]) == (
        "[mapping](#elastic) or null")


def test_template_is_a_valid_spec():
    spec = load_spec(TEMPLATE)
    assert spec.name == "my_study"


def test_template_names_every_key():
    data = yaml.safe_load(TEMPLATE.read_text())
    top = [k for k in StudySpec.model_fields if k != "spec_dir"]
    assert [k for k in top if k not in data] == [], "experiments/TEMPLATE.yaml lacks these keys"
    text = TEMPLATE.read_text()
    # nested keys appear too, written or (elastic's, the {name, dims} form) commented
    for section in reference.sections()[1:]:
        for name in reference._fields(section.model):
            assert f"{name}:" in text, (
                f"experiments/TEMPLATE.yaml does not mention {section.path}.{name}")


def test_template_values_are_the_defaults():
    spec = load_spec(TEMPLATE)
    default = StudySpec(name="x", model="llama2-tiny", hardware="cpu-local")
    keys = [k for k in StudySpec.model_fields if k not in REQUIRED_EXAMPLES | {"spec_dir"}]
    differ = [k for k in keys if getattr(spec, k) != getattr(default, k)]
    assert differ == [], f"experiments/TEMPLATE.yaml says a default it does not have: {differ}"


PAPER_SPECS = sorted((REPO / "experiments" / "paper").glob("*.yaml"))


def test_every_paper_spec_names_what_it_reproduces():
    assert len(PAPER_SPECS) >= 7  # the seven studies, plus specs that split one of them
    for spec in PAPER_SPECS:
        head = spec.read_text().split("\nname:")[0]
        assert head.startswith("# Reproduces: Fernandez et al. 2024"), (
            f"{spec.name}: start with a header naming the paper's study/claim it reproduces")
        figures = [f for f in DOCUMENTED_PATH.findall(head) if f.startswith("docs/figures/")]
        assert figures, f"{spec.name}: name its headline figure under docs/figures/"


# Paths the docs name, checked against the tree. Outputs of a run (results/, reports/), example
# names a user picks, and the file that must never exist (platform/__init__.py) are not in it.
DOCUMENTED_PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*\.(?:py|yaml|md|png)\b")
_NOT_IN_TREE = {"platform/__init__.py", "my.yaml", "profile.yaml", "cluster.yaml",
                "my-profile.yaml", "my_study.yaml", "calibrated-cpu-local.yaml", "plan.yaml"}
_BASES = ("", "platform/scalestudy", "platform", "analysis/scalestudy_analysis", "docs/figures")


def _documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
            *sorted((REPO / "experiments").rglob("*.yaml"))]


def test_paths_named_in_the_docs_exist():
    missing = []
    for doc in _documents():
        for path in set(DOCUMENTED_PATH.findall(doc.read_text())):
            path = path.removeprefix("./")
            if path.startswith(("results/", "reports/")) or {path, Path(path).name} & _NOT_IN_TREE:
                continue
            if not any((base / path).exists() for base in
                       (doc.parent, *(REPO / b for b in _BASES))):
                missing.append(f"{doc.relative_to(REPO)}: {path}")
    assert missing == [], "documented paths that do not exist: " + "; ".join(sorted(missing))
