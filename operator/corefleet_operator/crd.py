# SPDX-License-Identifier: Apache-2.0
"""Generate the EngineCoreSet CustomResourceDefinition from the typed models.

The schema is structural (every field typed, no $ref), carries the models' defaults so the API
server fills them in, their descriptions, bounds and CEL rules, the `status` and `scale`
subresources and the printer columns. Pure module: no kopf, no client, no I/O.
"""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args, get_origin

from corefleet_operator import constants
from corefleet_operator.models import (
    JSON,
    K8S_SCHEMAS,
    EngineCoreSetSpec,
    EngineCoreSetStatus,
    to_json,
)

# Lists whose items are keyed, so server-side apply merges them by key.
LIST_MAP_KEYS = {"conditions": ["type"], "ranks": ["rank"]}
# Schema keywords a field's metadata adds to (not replaces) in the generated schema: `items` of a list
# and `additionalProperties` of a map carry their element's bounds.
MERGED_KEYWORDS = ("items", "additionalProperties")


def cel_rules(rules: Sequence[tuple[str, ...]]) -> list[JSON]:
    """x-kubernetes-validations from a model's (rule, message[, messageExpression]) tuples."""
    out: list[JSON] = []
    for rule, message, *expression in rules:
        item: JSON = {"rule": rule, "message": message}
        if expression and expression[0]:
            item["messageExpression"] = expression[0]
        out.append(item)
    return out


def schema_for(tp: Any, *, with_defaults: bool = True) -> JSON:
    """OpenAPI v3 (structural) schema of a model type."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        props: JSON = {}
        required = []
        for f in dataclasses.fields(tp):
            sub = schema_for(hints[f.name], with_defaults=with_defaults)
            md = f.metadata
            if md.get("description"):
                sub["description"] = md["description"]
            for key, value in md.get("schema", {}).items():
                if key in MERGED_KEYWORDS and isinstance(sub.get(key), dict):
                    sub[key] = {**sub[key], **value}  # bounds of the items or values
                else:
                    sub[key] = value
            if f.name in LIST_MAP_KEYS and sub.get("type") == "array":
                sub["x-kubernetes-list-type"] = "map"
                sub["x-kubernetes-list-map-keys"] = LIST_MAP_KEYS[f.name]
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                required.append(f.name)
            elif with_defaults:
                default = _default_of(f)
                if default is not None:
                    sub["default"] = default
            props[f.name] = sub
        out: JSON = {"type": "object", "properties": props}
        if required:
            out["required"] = required
        rules = cel_rules(getattr(tp, "CEL_RULES", ()))
        if rules:
            out["x-kubernetes-validations"] = rules
        return out
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return schema_for(inner[0], with_defaults=with_defaults)
    if origin is Literal:
        return {"type": "string", "enum": list(get_args(tp))}
    if origin is tuple:
        return {"type": "array", "items": schema_for(get_args(tp)[0], with_defaults=with_defaults)}
    if origin is Mapping or tp is Mapping:
        return {"type": "object", "additionalProperties": {"type": "string"}}
    if isinstance(tp, type) and tp in K8S_SCHEMAS:
        copied: JSON = copy.deepcopy(K8S_SCHEMAS[tp])
        return copied
    simple = {bool: "boolean", int: "integer", str: "string"}
    if tp in simple:
        return {"type": simple[tp]}
    raise TypeError(f"no schema for {tp!r}")


def _default_of(f: dataclasses.Field[Any]) -> Any:
    """The default to publish in the schema: scalars and non-empty values; {} for nested models."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:  # pragma: no cover - required fields have no default
        return None
    if value is None:
        return None
    if dataclasses.is_dataclass(value):
        return {}  # the API server then applies the nested defaults
    js = to_json(value)
    if js in ({}, [], ""):
        return None
    return js


def spec_schema() -> JSON:
    schema = schema_for(EngineCoreSetSpec)  # with its CEL_RULES (and those of nested models)
    rules = schema.setdefault("x-kubernetes-validations", [])
    for name in EngineCoreSetSpec.IMMUTABLE:
        rules.append({"rule": f"self.{name} == oldSelf.{name}",
                      "message": f"{name} is immutable: create a new EngineCoreSet instead"})
    schema["x-kubernetes-validations"] = rules
    return schema


def status_schema() -> JSON:
    # Status carries no defaults: it is written whole by the operator.
    return schema_for(EngineCoreSetStatus, with_defaults=False)


PRINTER_COLUMNS = [
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas", "description": "Desired ranks"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Ranks serving"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> JSON:
    """The whole CustomResourceDefinition."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": constants.CRD_NAME,
            "labels": {constants.LABEL_MANAGED_BY: constants.MANAGED_BY},
        },
        "spec": {
            "group": constants.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": constants.KIND,
                "plural": constants.PLURAL,
                "singular": constants.SINGULAR,
                "shortNames": list(constants.SHORT_NAMES),
                "listKind": f"{constants.KIND}List",
                "categories": ["corefleet"],
            },
            "versions": [{
                "name": constants.VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A data-parallel fleet of vLLM engine cores behind one OpenAI-compatible "
                                   "frontend, resized in place without Ray.",
                    "required": ["spec"],
                    "x-kubernetes-validations": cel_rules(EngineCoreSetSpec.OBJECT_CEL_RULES),
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema(),
                        "status": status_schema(),
                    },
                }},
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.selector",
                    },
                },
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }
