"""The ``rlhf manifests`` subcommand (KubeRay objects of a run), registered with the
``rlhf`` command through the ``rlhf.commands`` entry point; rlhf_core never imports it."""

from __future__ import annotations

import argparse
import os


def _cmd_manifests(args: argparse.Namespace) -> int:
    import yaml

    from components.kuberay import crd, render, spec
    from components.kuberay.names import KubeNameError
    from rlhf_core.config import ConfigError

    try:
        cfg, kube = spec.load_deployment(args.config, args.overrides)
        objects = render.render_all(cfg, kube, args.run_id, args.store)
        if args.crds:
            for obj in objects.values():
                if obj["kind"] in crd.CRD_FILES:  # the head's account and RBAC are core kinds
                    crd.validate(obj, args.crds)
    except (spec.DeploySpecError, render.PoolShapeError, KubeNameError, crd.SchemaViolation) as exc:
        raise SystemExit(f"rlhf: {exc}") from None
    except ConfigError as exc:  # the deployment file's or the overrides' run config
        raise SystemExit(f"rlhf: config error: {exc}") from None
    os.makedirs(args.out, exist_ok=True)
    for name, obj in objects.items():
        path = os.path.join(args.out, name)
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(obj, f, sort_keys=False)
        for item in obj.get("items", [obj]):
            print(f"{item['kind']} {item['metadata']['namespace']}/{item['metadata']['name']}: {path}")
    return 0


def register(sub, api) -> None:
    from rlhf_core.cli_args import add_run_arguments

    man = sub.add_parser("manifests", help="render the run's KubeRay RayCluster and RayJob "
                         "(and the head's account) as YAML")
    man.add_argument("--config", default=None, help="deployment file: run config sections plus a `kubernetes:` "
                     "section (default: the default run config; see manifests/configs/)")
    add_run_arguments(man, run_id="demo", store="s3://rlhf/runs",
                      run_id_help="names the cluster (normalized to a DNS-1035 label)",
                      store_help="object store URI the session restores from")
    man.add_argument("--out", required=True, help="folder for raycluster.yaml, rayjob.yaml and "
                     "head-account.yaml (the head's service account and RBAC, applied with either)")
    man.add_argument("--crds", default=None, help="validate against the KubeRay CRDs in this folder first")
    man.add_argument("overrides", nargs="*")
    man.set_defaults(func=_cmd_manifests)
