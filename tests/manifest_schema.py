"""The manifest's JSON Schema (docs/manifest.schema.json) as a validator, for the tests that hold manifests to it."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "docs" / "manifest.schema.json"


@functools.cache
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


@functools.cache
def _validator() -> Any:
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(schema())
    return jsonschema.Draft202012Validator(schema())


def schema_errors(doc: Any) -> list[str]:
    """Every way ``doc`` breaks the schema, as ``"<json path>: <message>"`` (empty when it is valid)."""
    return [
        f"{e.json_path}: {e.message[:300]}"
        for e in sorted(_validator().iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


def assert_valid(path: str | Path, full: bool = False) -> dict[str, Any]:
    """Validate the manifest file at ``path`` (a manifest.json or its checkpoint folder); return the document.

    ``full``: return instead the checkpoint's whole manifest as its v1 document (``tensors[n]["shards"]``, every
    rank's ``rng`` and ``data``), read through the public reader from whichever version is stored, and validated
    too: tests that check facts (not one version's layout) then hold under format v1 and v2 alike."""
    p = Path(path)
    if p.is_dir():
        p = p / "manifest.json"
    doc = json.loads(p.read_text())
    errors = schema_errors(doc)
    assert not errors, f"{p} breaks docs/manifest.schema.json:\n" + "\n".join(errors[:20])
    if not full:
        return doc
    from manifest_io import manifest_dict

    facts = manifest_dict(p.parent)
    errors = schema_errors(facts)
    assert not errors, f"{p} read as v1 breaks docs/manifest.schema.json:\n" + "\n".join(errors[:20])
    return facts
