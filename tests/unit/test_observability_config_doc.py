"""docs/configuration.md is the generator's output for the schema as it is now."""

from __future__ import annotations

from pathlib import Path

from poolgate.config_doc import field_docstrings, render
from poolgate.kernel.config import Config, PoolSpec

ROOT = Path(__file__).resolve().parents[2]


def test_committed_reference_is_current() -> None:
    assert (ROOT / "docs" / "configuration.md").read_text() == render(), (
        "docs/configuration.md is stale: run `python -m poolgate.config_doc > docs/configuration.md`")


def test_field_docstrings_come_from_the_source() -> None:
    assert field_docstrings(PoolSpec)["model"].startswith("The served model name")
    assert "redis_url" in field_docstrings(Config)


def test_every_model_and_field_is_documented_somewhere() -> None:
    text = render()
    for section in ("## Top level", "## `pools[]`", "## `autoscale.pools.<name>.template`", "## `tenants[]`"):
        assert section in text
    for name in Config.model_fields:
        assert f"| `{name}` |" in text
