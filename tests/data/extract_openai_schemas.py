"""Regenerate the trimmed copies of OpenAI's published OpenAPI spec (MIT, github.com/openai/openai-openapi) beside
this file.

Usage::

    python tests/data/extract_openai_schemas.py path/to/openapi.json COMMIT > openai_response_schemas.json
    python tests/data/extract_openai_schemas.py --requests path/to/openapi.json COMMIT > openai_request_examples.json

Responses: the response schemas the conformance tests validate against and every schema they reference, unchanged
except for one mechanical translation: OpenAPI 3.0's ``nullable: true`` (which JSON Schema validators ignore) becomes
JSON Schema's ``anyOf [..., null]``.

Requests (``--requests``), for the endpoints kvboost serves (``POST /chat/completions``, ``POST /completions``,
``GET /models``, ``GET /models/{model}``):

- ``examples``: every request example of the spec's ``x-oaiMeta`` for those operations, the JSON body parsed from its
  ``curl`` form (``-d '...'``) exactly as published, the path and method;
- ``field_examples``: per endpoint, the ``example`` values the request schema gives its top-level fields (found at
  the field's schema, its ``$ref``, its ``allOf`` / ``oneOf`` / ``anyOf`` branches; an ``items.example`` is one
  item, so the field's value is a one-item list), each as published;
- ``components.schemas``: the request schemas (``CreateChatCompletionRequest``, ``CreateCompletionRequest``) and every
  schema they reference, with the same ``nullable`` translation, ``x-*`` annotations, examples, ``description`` and
  ``title`` dropped (structure only: the tests validate bodies against them).
"""

from __future__ import annotations

import copy
import json
import re
import sys
from typing import Any

ROOTS = ["CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse",
         "ErrorResponse"]  # fmt: skip
REQUEST_ROOTS = ["CreateChatCompletionRequest", "CreateCompletionRequest"]
#: (method, spec path) of each operation kvboost serves, and its request schema (None: no body)
OPERATIONS = [("post", "/chat/completions", "CreateChatCompletionRequest"),
              ("post", "/completions", "CreateCompletionRequest"),
              ("get", "/models", None), ("get", "/models/{model}", None)]  # fmt: skip
SCHEMA_PREFIX = "#/components/schemas/"


def refs(node, out):
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(SCHEMA_PREFIX):
            out.add(ref.rsplit("/", 1)[1])
        for value in node.values():
            refs(value, out)
    elif isinstance(node, list):
        for value in node:
            refs(value, out)


def denull(node, drop=()):
    """``nullable: true`` -> ``anyOf: [<the schema>, {"type": "null"}]``; ``x-*`` annotations, examples and the
    annotation keys in ``drop`` dropped (from schemas, not from ``properties`` maps, whose keys are field names)."""
    if isinstance(node, list):
        return [denull(v, drop) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: ({f: denull(v, drop) for f, v in value.items()} if k == "properties" else denull(value, drop))
            for k, value in node.items() if not k.startswith("x-") and k not in ("example", "examples", *drop)}
    if node.pop("nullable", False):
        desc = node.pop("description", None)
        out = {"anyOf": [node, {"type": "null"}]}
        if desc is not None:
            out["description"] = desc
        return out
    return node


def closure(schemas, roots):
    """``roots`` and every schema they reference, by name."""
    keep, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        found: set[str] = set()
        refs(schemas[name], found)
        todo += sorted(found - keep)
    return keep


def curl_body(curl: str) -> Any:
    """The JSON body of a ``curl ... -d '<json>'`` example (None: the example sends no body)."""
    match = re.search(r"-d '(.*)'\s*$", curl, re.DOTALL)
    return json.loads(match.group(1)) if match else None


def request_examples(spec):
    out = []
    for method, path, _ in OPERATIONS:
        op = spec["paths"][path][method]
        examples = op.get("x-oaiMeta", {}).get("examples", [])
        for example in examples if isinstance(examples, list) else [examples]:
            curl = example["request"]["curl"]
            out.append({"operation": op["operationId"], "method": method.upper(), "path": path,
                        "title": example.get("title") or op["summary"], "body": curl_body(curl)})  # fmt: skip
    return out


def field_examples(schemas, root):
    """``{field: [example values]}`` of a request schema's top-level fields (see the module docstring)."""
    found: dict[str, list[Any]] = {}

    def resolve(node):
        while isinstance(node, dict) and "$ref" in node:
            node = schemas[node["$ref"].rsplit("/", 1)[1]]
        return node

    def values(node):
        node = resolve(node)
        if not isinstance(node, dict):
            return []
        out = [node["example"]] if "example" in node else []
        if isinstance(node.get("items"), dict) and "example" in resolve(node["items"]):
            out.append([resolve(node["items"])["example"]])
        for key in ("allOf", "oneOf", "anyOf"):
            for branch in node.get(key, []):
                out += values(branch)
        return out

    def walk(node):
        node = resolve(node)
        for name, prop in node.get("properties", {}).items():
            for value in values(prop):
                if value not in found.setdefault(name, []):
                    found[name].append(value)
        for branch in node.get("allOf", []):
            walk(branch)

    walk(schemas[root])
    return {name: vals for name, vals in sorted(found.items()) if vals}


def main(path: str, commit: str, requests: bool = False) -> None:
    with open(path) as f:
        spec = json.load(f)
    schemas = spec["components"]["schemas"]
    source = (f"OpenAI's published OpenAPI spec (https://github.com/openai/openai-openapi, openapi.json at commit "
              f"{commit}, spec version {spec['info'].get('version')}), MIT License, Copyright (c) OpenAI: see "
              "openai-openapi.LICENSE beside this file. Extracted by extract_openai_schemas.py")  # fmt: skip
    if requests:
        out = {
            "$comment": f"Request examples and request schemas of {source} --requests (examples as published; "
            "schemas: nullable -> anyOf null; x-* annotations, examples, descriptions and titles dropped).",
            "examples": request_examples(spec),
            "field_examples": {p: field_examples(schemas, root) for _, p, root in OPERATIONS if root},
            "components": {"schemas": {name: denull(copy.deepcopy(schemas[name]), ("description", "title"))
                                       for name in sorted(closure(schemas, REQUEST_ROOTS))}},
        }  # fmt: skip
    else:
        out = {
            "$comment": f"Response schemas of {source} (nullable -> anyOf null; x-* annotations and examples "
            "dropped).",
            "components": {"schemas": {name: denull(copy.deepcopy(schemas[name]))
                                       for name in sorted(closure(schemas, ROOTS))}},
        }  # fmt: skip
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    args = sys.argv[1:]
    flag = "--requests" in args
    args = [a for a in args if a != "--requests"]
    main(args[0], args[1], requests=flag)
