#!/usr/bin/env python3
"""Validate sandcell's Kubernetes deployment offline (no cluster): run by deploy/local/test.sh.

1. Every object the kustomization lists, strictly (unknown fields refused) against the schemas
   of a pinned Kubernetes version, bundled by the `kubernetes-validate` package (PyPI).
2. KEDA's and the Prometheus operator's objects against the CRD schemas those projects publish,
   packaged by `@kubernetes-models/*` (npm), through crds.mjs.
3. The alert rules with `promtool check rules` (Debian's `prometheus`).
4. What must agree between files: the PrometheusRule is alerts.yml; every file of the directory
   is listed in the kustomization; every variable the ConfigMap sets is documented in
   docs/configuration.md; the worker pod's termination grace exceeds the drain it must allow.
5. With `--scrape FILE...` (live scrapes of the running binaries' /metrics): every metric an
   alert, a dashboard panel or the autoscaler names is in them.

Each validator is first shown an object it must refuse, so a validator that accepts anything
fails the run instead of passing it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import kubernetes_validate
import yaml

# The Kubernetes version the manifests target: native sidecars (an init container with
# `restartPolicy: Always`) are on by default from 1.29 and GA in 1.33.
KUBERNETES_VERSION = "1.33.0"

HERE = pathlib.Path(__file__).resolve().parent
MANIFESTS = HERE.parent
REPO = MANIFESTS.parent.parent
CUSTOM_GROUPS = ("keda.sh/", "monitoring.coreos.com/")
# Files of the directory that are not Kubernetes objects.
NOT_OBJECTS = {"kustomization.yaml", "monitoring/alerts.yml", "monitoring/dashboard.json"}
# SANDCELL_DRAIN_GRACE_S plus the up to 20 s sessions take to save their variables.
SNAPSHOT_GRACE_S = 20

failures: list[str] = []


def fail(what: str) -> None:
    failures.append(what)
    print(f"FAIL {what}", flush=True)


def ok(what: str) -> None:
    print(f"ok   {what}", flush=True)


def load_all(path: pathlib.Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def name_of(doc: dict[str, Any]) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def listed_resources() -> list[tuple[str, dict[str, Any]]]:
    """The objects the kustomization lists, with the file each comes from."""
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    listed = list(kustomization["resources"])
    for generated in kustomization.get("configMapGenerator", []):
        listed += generated.get("files", [])
    present = sorted(
        str(p.relative_to(MANIFESTS))
        for p in MANIFESTS.rglob("*")
        if p.is_file() and p.suffix in (".yaml", ".yml", ".json") and HERE not in p.parents
    )
    unlisted = [p for p in present if p not in listed and p not in NOT_OBJECTS]
    if unlisted:
        fail(f"kustomization.yaml does not list {unlisted}")
    missing = [p for p in listed if not (MANIFESTS / p).is_file()]
    if missing:
        fail(f"kustomization.yaml lists missing files {missing}")
    out = []
    for rel in kustomization["resources"]:
        for doc in load_all(MANIFESTS / rel):
            out.append((rel, doc))
    return out


def core_errors(doc: dict[str, Any]) -> str | None:
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as e:
        return str(e).splitlines()[0]
    return None


def crd_verdicts(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    node_modules = os.environ.get("SANDCELL_CRD_NODE_MODULES", str(HERE / "node_modules"))
    env = dict(os.environ, NODE_PATH=node_modules)
    # ESM resolves packages from the script's directory upwards: run it where node_modules is.
    script = pathlib.Path(node_modules).parent / "crds.mjs"
    if script.resolve() != (HERE / "crds.mjs").resolve():
        script.write_text((HERE / "crds.mjs").read_text())
    run = subprocess.run(["node", str(script)], input=json.dumps(docs), capture_output=True, text=True, env=env, check=False)
    if run.returncode != 0:
        raise SystemExit(f"crds.mjs failed: {run.stderr.strip()}")
    verdicts: list[dict[str, Any]] = json.loads(run.stdout)
    return verdicts


def check_objects(objects: list[tuple[str, dict[str, Any]]]) -> None:
    core = [(f, d) for f, d in objects if not d["apiVersion"].startswith(CUSTOM_GROUPS)]
    custom = [(f, d) for f, d in objects if d["apiVersion"].startswith(CUSTOM_GROUPS)]

    # The validators must refuse what is wrong before their passes mean anything.
    deployment = next(d for _, d in core if d["kind"] == "Deployment")
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolicie"] = "Always"
    if core_errors(broken) is None:
        fail("kubernetes-validate accepted a container with an unknown field")
    scaled = next(d for _, d in custom if d["kind"] == "ScaledObject")
    wrong = copy.deepcopy(scaled)
    wrong["spec"]["minReplicaCount"] = "one"
    if crd_verdicts([wrong])[0]["ok"]:
        fail("the KEDA schema accepted a ScaledObject whose minReplicaCount is a string")

    for f, d in core:
        err = core_errors(d)
        if err:
            fail(f"{f}: {name_of(d)} against Kubernetes {KUBERNETES_VERSION}: {err}")
        else:
            ok(f"{f}: {name_of(d)} (Kubernetes {KUBERNETES_VERSION}, strict)")
    for (f, d), v in zip(custom, crd_verdicts([d for _, d in custom])):
        if v["ok"]:
            ok(f"{f}: {name_of(d)} ({d['apiVersion']} CRD schema)")
        else:
            fail(f"{f}: {name_of(d)}: {v['error']}")


def check_agreements(objects: list[tuple[str, dict[str, Any]]]) -> None:
    by_kind = {(d["kind"], d["metadata"]["name"]): d for _, d in objects}
    rules = yaml.safe_load((MANIFESTS / "monitoring/alerts.yml").read_text())
    if by_kind[("PrometheusRule", "sandcell")]["spec"] != rules:
        fail("monitoring/prometheus-rule.yaml differs from monitoring/alerts.yml")
    else:
        ok("PrometheusRule sandcell = monitoring/alerts.yml")

    config = by_kind[("ConfigMap", "sandcell-config")]["data"]
    documented = set(re.findall(r"`(SANDCELL_[A-Z0-9_]+|DOCKER_HOST)`", (REPO / "docs/configuration.md").read_text()))
    undocumented = sorted(k for k in config if k not in documented)
    if undocumented:
        fail(f"the ConfigMap sets variables docs/configuration.md does not know: {undocumented}")
    else:
        ok(f"the ConfigMap's {len(config)} variables are documented")

    worker = by_kind[("Deployment", "sandcell-worker")]["spec"]["template"]["spec"]
    drain = int(config["SANDCELL_DRAIN_GRACE_S"])
    grace = worker["terminationGracePeriodSeconds"]
    if grace <= drain + SNAPSHOT_GRACE_S:
        fail(f"worker terminationGracePeriodSeconds {grace} does not cover the drain ({drain} s + {SNAPSHOT_GRACE_S} s of snapshots)")
    else:
        ok(f"worker grace {grace} s > drain {drain} s + snapshots {SNAPSHOT_GRACE_S} s")
    privileged = [c["name"] for c in worker.get("initContainers", []) + worker["containers"] if c.get("securityContext", {}).get("privileged")]
    if privileged != ["engine"]:
        fail(f"the privileged containers of the worker pod are {privileged}, not just the engine")
    else:
        ok("only the engine sidecar is privileged")


def promtool(promtool_bin: str) -> None:
    run = subprocess.run([promtool_bin, "check", "rules", "monitoring/alerts.yml"], cwd=MANIFESTS, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        fail(f"promtool check rules monitoring/alerts.yml: {(run.stdout + run.stderr).strip()}")
    else:
        ok("promtool check rules monitoring/alerts.yml")
    # promtool must refuse a broken rule, or its passes mean nothing.
    broken = MANIFESTS / "validate" / ".broken-rules.yml"
    broken.write_text("groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: sum(rate(sandcell_jobs[5m])\n")
    run = subprocess.run([promtool_bin, "check", "rules", str(broken)], capture_output=True, text=True, check=False)
    broken.unlink()
    if run.returncode == 0:
        fail("promtool accepted a rule with unbalanced parentheses")


def write_rule() -> None:
    """monitoring/prometheus-rule.yaml: the groups of monitoring/alerts.yml, as a PrometheusRule."""
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "sandcell", "namespace": "sandcell", "labels": {"app.kubernetes.io/name": "sandcell"}},
        "spec": yaml.safe_load((MANIFESTS / "monitoring/alerts.yml").read_text()),
    }
    header = "# Written by deploy/kubernetes/validate/validate.py --write-rule from alerts.yml (edit that, then\n# run it): CI fails when the two differ.\n"
    (MANIFESTS / "monitoring/prometheus-rule.yaml").write_text(header + yaml.safe_dump(rule, sort_keys=False, width=120))


def named_metrics(objects: list[tuple[str, dict[str, Any]]]) -> set[str]:
    exprs: list[str] = []
    rules = yaml.safe_load((MANIFESTS / "monitoring/alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dashboard = json.loads((MANIFESTS / "monitoring/dashboard.json").read_text())
    exprs += [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for _, d in objects:
        if d["kind"] == "ScaledObject":
            exprs += [t["metadata"]["query"] for t in d["spec"]["triggers"] if t["type"] == "prometheus"]
    return set(re.findall(r"\bsandcell_[a-z0-9_]+", " ".join(exprs)))


def check_scrapes(objects: list[tuple[str, dict[str, Any]]], scrapes: list[str]) -> None:
    exposed: set[str] = set()
    for path in scrapes:
        for line in pathlib.Path(path).read_text().splitlines():
            if line and not line.startswith("#"):
                exposed.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    names = named_metrics(objects)
    absent = sorted(n for n in names if n not in exposed)
    if absent:
        fail(f"metrics named by alerts, dashboard or autoscaler but absent from the live scrapes: {absent}")
    else:
        ok(f"all {len(names)} metrics the alerts, the dashboard and the autoscaler name are in the live scrapes")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--promtool", default="promtool", help="the promtool binary")
    parser.add_argument("--scrape", nargs="*", default=[], help="files holding live /metrics scrapes")
    parser.add_argument("--write-rule", action="store_true", help="write monitoring/prometheus-rule.yaml from monitoring/alerts.yml, then check")
    args = parser.parse_args()
    if args.write_rule:
        write_rule()
    objects = listed_resources()
    check_objects(objects)
    check_agreements(objects)
    promtool(args.promtool)
    if args.scrape:
        check_scrapes(objects, args.scrape)
    if failures:
        print(f"{len(failures)} check(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
