"""Cut KubeRay's RayJob CRD (1.4 MB, mostly expanded pod templates) down to the JSON schema that k8s/rayjob.yaml
needs, made strict: every object lists all the property names the CRD allows (unknown names fail), but only the
branches the manifest uses keep their sub-schemas; an unused branch becomes a schema that fails with a message.

    git show <commit>:ray-operator/config/crd/bases/ray.io_rayjobs.yaml > /tmp/crd.yaml   # ray-project/kuberay
    python tests/data/kuberay/vendor_rayjob_schema.py /tmp/crd.yaml k8s/rayjob.yaml <commit> \
        > tests/data/kuberay/rayjob_v1_schema.json
"""

import json
import sys

import yaml

UNUSED = {"not": {}, "description": "field allowed by the CRD but pruned from the vendored subset: re-vendor it"}


def strict(schema: dict, values: list) -> dict:
    """The CRD's structural schema as JSON schema, pruned to the `values` seen at this node."""
    out = {k: v for k, v in schema.items() if k not in ("properties", "items", "additionalProperties")
           and not k.startswith("x-kubernetes")}
    if schema.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in schema:
        seen = [v for v in values if isinstance(v, dict)]
        out["properties"] = {
            name: strict(sub, [v[name] for v in seen if name in v]) if any(name in v for v in seen) else UNUSED
            for name, sub in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        seen = [x for v in values if isinstance(v, dict) for x in v.values()]
        out["additionalProperties"] = strict(schema["additionalProperties"], seen)
    if "items" in schema:
        out["items"] = strict(schema["items"], [x for v in values if isinstance(v, list) for x in v])
    return out


def main(crd_path: str, manifest_path: str, commit: str) -> None:
    crd = yaml.safe_load(open(crd_path))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    manifest = yaml.safe_load(open(manifest_path))
    schema = strict(version["schema"]["openAPIV3Schema"], [manifest])
    schema["$comment"] = (f"ray-project/kuberay@{commit} ray-operator/config/crd/bases/ray.io_rayjobs.yaml, v1, "
                          f"pruned to {manifest_path} by tests/data/kuberay/vendor_rayjob_schema.py")
    json.dump(schema, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main(*sys.argv[1:])
