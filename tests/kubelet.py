"""A container's environment as the kubelet builds it, for tests of the manifests in config/."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any


def container_env(
    container: Mapping[str, Any], secrets: Mapping[str, str], pod_name: str
) -> dict[str, str]:
    """``env`` with ``$(VAR)`` expanded, secrets from ``secrets``, the pod name as given."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            # $(VAR) refers to a variable defined earlier in the list, as in Kubernetes.
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), str(entry["value"]))
        elif "secretKeyRef" in entry["valueFrom"]:
            value = secrets[entry["valueFrom"]["secretKeyRef"]["key"]]
        else:
            assert entry["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            value = pod_name
        env[entry["name"]] = value
    return env
