"""JSON-schema views the drafter reads: references inlined, the alternatives a value may take.

Tool schemas come in every style: ``$ref`` into ``$defs``, ``anyOf`` / ``oneOf`` branches, type
lists with ``null``, ``const``. The drafter asks three questions of a schema -- what may a value
start with, which keys may an object have, what is an array's item -- and these functions answer
them for all of those styles. Every walk is depth-capped, so no schema (however deep or
self-referencing) can recurse without bound.
"""

from __future__ import annotations

MAX_DEPTH = 24  # deeper than any real tool schema; a deeper one is cut (drafted as free)


def inline_refs(schema, root: dict | None = None, depth: int = 0):
    """``schema`` with local ``$ref`` ("#/$defs/X", "#/definitions/X") replaced by their target,
    ``$defs`` dropped; a reference cycle or a schema deeper than ``MAX_DEPTH`` becomes ``{}``."""
    root = schema if root is None else root
    if depth > MAX_DEPTH:
        return {}
    if isinstance(schema, list):
        return [inline_refs(s, root, depth + 1) for s in schema]
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = _pointer(root, ref)
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        if isinstance(target, dict):
            return inline_refs({**target, **rest}, root, depth + 1)
        return inline_refs(rest, root, depth + 1)
    return {k: inline_refs(v, root, depth + 1) for k, v in schema.items() if k not in ("$defs", "definitions")}


def _pointer(root: dict, ref: str):
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def variants(schema, depth: int = 0) -> list[dict]:
    """The alternatives a value of ``schema`` may take, each with one ``type`` (or none said):
    ``anyOf`` / ``oneOf`` branches (with the keys beside them), one per type of a type list
    (``["string", "null"]``), ``const`` as a one-value ``enum``."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return [{}]
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            rest = {k: v for k, v in schema.items() if k != key}
            return [v for b in branches if isinstance(b, dict) for v in variants({**rest, **b}, depth + 1)] or [{}]
    if "const" in schema:
        schema = {**{k: v for k, v in schema.items() if k != "const"}, "enum": [schema["const"]]}
    types = schema.get("type")
    if isinstance(types, list):
        return [{**schema, "type": t} for t in types if isinstance(t, str)] or [{}]
    return [schema]


def properties(schema) -> dict:
    """The keys an object of ``schema`` may have (across its object alternatives) and their schemas."""
    out: dict = {}
    for v in variants(schema):
        props = v.get("properties")
        if isinstance(props, dict):
            for k, s in props.items():
                out.setdefault(k, s)
    return out


def required(schema) -> list[str]:
    """Keys every object alternative of ``schema`` requires."""
    objs = [v for v in variants(schema) if isinstance(v.get("properties"), dict) or "required" in v]
    if not objs:
        return []
    first = [k for k in objs[0].get("required") or [] if isinstance(k, str)]
    return [k for k in first if all(k in (o.get("required") or []) for o in objs[1:])]


def items(schema) -> dict | None:
    """The schema of an array's items (its first array alternative's)."""
    for v in variants(schema):
        it = v.get("items")
        if isinstance(it, dict):
            return it
    return None


def enum_values(schema) -> list | None:
    """The values a scalar may take when every alternative lists them (``enum`` / ``const``), else None."""
    out: list = []
    for v in variants(schema):
        enum = v.get("enum")
        if not isinstance(enum, list):
            return None
        out += [e for e in enum if e not in out]
    return out or None
