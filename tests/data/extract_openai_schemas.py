"""Regenerate ``openai_response_schemas.json`` from OpenAI's published OpenAPI spec (MIT, github.com/openai/openai-openapi).

Usage: ``python tests/data/extract_openai_schemas.py path/to/openapi.json COMMIT``. Keeps the response schemas the
conformance tests validate against and every schema they reference, unchanged except for one mechanical translation:
OpenAPI 3.0's ``nullable: true`` (which JSON Schema validators ignore) becomes JSON Schema's ``anyOf [..., null]``.
"""

from __future__ import annotations

import copy
import json
import sys

ROOTS = ["CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse",
         "ErrorResponse"]  # fmt: skip


def refs(node, out):
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            out.add(ref.rsplit("/", 1)[1])
        for value in node.values():
            refs(value, out)
    elif isinstance(node, list):
        for value in node:
            refs(value, out)


def denull(node):
    """``nullable: true`` -> ``anyOf: [<the schema>, {"type": "null"}]``; ``x-*`` annotations and examples dropped."""
    if isinstance(node, list):
        return [denull(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: denull(v) for k, v in node.items() if not k.startswith("x-") and k not in ("example", "examples")}
    if node.pop("nullable", False):
        desc = node.pop("description", None)
        out = {"anyOf": [node, {"type": "null"}]}
        if desc is not None:
            out["description"] = desc
        return out
    return node


def main(path: str, commit: str) -> None:
    with open(path) as f:
        spec = json.load(f)
    schemas = spec["components"]["schemas"]
    keep, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        found: set[str] = set()
        refs(schemas[name], found)
        todo += sorted(found - keep)
    out = {
        "$comment": "Response schemas of OpenAI's published OpenAPI spec (https://github.com/openai/openai-openapi, "
        f"openapi.json at commit {commit}, spec version {spec['info'].get('version')}), MIT License, "
        "Copyright (c) OpenAI: see openai-openapi.LICENSE beside this file. Extracted by "
        "extract_openai_schemas.py (nullable -> anyOf null; x-* annotations and examples dropped).",
        "components": {"schemas": {name: denull(copy.deepcopy(schemas[name])) for name in sorted(keep)}},
    }
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
