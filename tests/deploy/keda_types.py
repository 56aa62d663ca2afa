"""KEDA's own types for keda.sh objects (cloudcoil-models-keda, a pinned dev dependency from the package registry:
never a copy of KEDA's CRDs here). 2.20.2.x declares Python >= 3.14 and uses its syntax; 2.16.1.0 is the newest that
runs on the project's Python, and has every field rollq's objects use (scalingModifiers: KEDA >= 2.12)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def keda_model(obj: Mapping[str, Any]):
    """KEDA's own type for a keda.sh object (cloudcoil-models-keda), by apiVersion and kind."""
    import importlib

    group, _, version = obj["apiVersion"].partition("/")
    module = {"keda.sh": "cloudcoil.models.keda", "eventing.keda.sh": "cloudcoil.models.keda.eventing"}[group]
    model = getattr(importlib.import_module(f"{module}.{version}"), obj["kind"], None)
    assert model is not None, f"cloudcoil-models-keda has no {obj['apiVersion']} {obj['kind']}"
    return model


def unknown_fields(given: Any, kept: Any, path: str = "") -> list[str]:
    """Paths of `given` that the validated model dropped: the models ignore fields they do not know, so an unknown
    (misspelt) field shows as one missing from what the model kept."""
    if isinstance(given, Mapping):
        if not isinstance(kept, Mapping):
            return [path or "/"]
        out = []
        for key, value in given.items():
            out += [f"{path}/{key}"] if key not in kept else unknown_fields(value, kept[key], f"{path}/{key}")
        return out
    if isinstance(given, list) and isinstance(kept, list):
        pairs = enumerate(zip(given, kept, strict=False))
        return [p for i, (g, k) in pairs for p in unknown_fields(g, k, f"{path}/{i}")]
    return []


def validate_keda(obj: Mapping[str, Any]) -> None:
    model = keda_model(obj)
    parsed = model.model_validate(obj)
    kept = parsed.model_dump(by_alias=True, exclude_unset=True, mode="json")
    unknown = unknown_fields(obj, kept)
    assert not unknown, f"{obj['kind']} {obj['metadata']['name']}: fields KEDA does not know: {unknown}"
