"""Where the run to inspect is: a run directory, a config file, a URL, or the only
run with pools in the Redis reached (``resolve``, ``pick_run``)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import redis

from pipeline.redisd.tls import TLSFiles, is_tls


@dataclass
class Target:
    url: str
    prefix: str
    run: str
    tls: TLSFiles | None = None  # rediss://: the CA, client certificate and key


# ------------------------------------------------------------------ where the run is


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _config_names(path: str) -> tuple[str | None, str | None]:
    """(redis.prefix, run.name) from a saved config.yaml, without the full schema."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(path)
    return OmegaConf.select(cfg, "redis.prefix"), OmegaConf.select(cfg, "run.name")


def discover_runs(client: redis.Redis) -> list[tuple[str, str]]:
    """Every (prefix, run) that has a pool status hash in this Redis."""
    found = set()
    for key in client.scan_iter(match="*:status:*", count=500):
        parts = key.decode().split(":")
        if len(parts) >= 4 and parts[-2] == "status":
            run = parts[-3]  # redis.mode=cluster: the hash tag {run}
            if run.startswith("{") and run.endswith("}"):
                run = run[1:-1]
            found.add((":".join(parts[:-3]), run))
    return sorted(found)


def resolve(args: argparse.Namespace) -> Target:
    """The Redis URL, prefix and run name from the arguments (errors say what to pass)."""
    prefix, run, url, tls = args.prefix, args.run, args.url, None
    config = args.config
    if args.run_dir:
        rd = args.run_dir
        if not os.path.isdir(rd):
            raise ValueError(f"--run-dir {rd} is not a directory")
        url_f = os.path.join(rd, "redis", "url")  # written by the Slurm scripts (deploy/slurm)
        port_f, auth_f = os.path.join(rd, "redis", "port"), os.path.join(rd, "redis", "auth")
        tls_dir = os.path.join(rd, "redis", "tls")  # redis.tls=true: the run's certificates
        run_tls = os.path.exists(os.path.join(tls_dir, "ca.crt"))
        if run_tls:
            files = {k: os.path.join(tls_dir, f) for k, f in RUN_TLS.items()}
            tls = TLSFiles(**files, origin={k: "--run-dir" for k in files})
        if url is None and os.path.exists(url_f):  # redis=ha, redis=cluster: their URL
            url = _read(url_f)
        elif url is None:
            if not os.path.exists(port_f):
                raise ValueError(
                    f"{port_f} does not exist: {rd} has no embedded redis-server; "
                    "pass --url redis://... for a run on an external Redis"
                )
            auth = _read(auth_f) if os.path.exists(auth_f) else ""
            scheme = "rediss" if run_tls else "redis"
            url = f"{scheme}://:{auth}@127.0.0.1:{_read(port_f)}/0"
        if config is None and os.path.exists(os.path.join(rd, "config.yaml")):
            config = os.path.join(rd, "config.yaml")
    if config:
        if not os.path.exists(config):
            raise ValueError(f"--config {config} does not exist")
        cfg_prefix, cfg_run = _config_names(config)
        prefix, run = prefix or cfg_prefix, run or cfg_run
    url = url or os.environ.get("NONSTOP_REDIS_URL")
    if not url:
        raise ValueError(
            "no Redis to inspect: pass --run-dir DIR, --url redis://... or set NONSTOP_REDIS_URL"
        )
    # rediss://, rediss+sentinel://, rediss+cluster://: the files given, else the run's
    tls = (_tls(args, config) or tls) if is_tls(url) else None
    return Target(url=url, prefix=prefix or "", run=run or "", tls=tls)


RUN_TLS = {"ca": "ca.crt", "cert": "client.crt", "key": "client.key"}  # launcher's names


def _tls(args: argparse.Namespace, config: str | None) -> TLSFiles | None:
    """TLS files from --tls-ca/--tls-cert/--tls-key, else NONSTOP_REDIS_TLS_* or the
    config's redis.tls (None: none of them names a file)."""
    from omegaconf import OmegaConf

    from pipeline.config import tls_files

    given = {k: getattr(args, f"tls_{k}", None) or "" for k in ("ca", "cert", "key")}
    if any(given.values()):
        for k, path in given.items():
            if path and not os.path.exists(path):
                raise ValueError(f"--tls-{k} {path} does not exist")
        if bool(given["cert"]) != bool(given["key"]):
            raise ValueError("--tls-cert and --tls-key go together: pass both, or neither")
        return TLSFiles(**given, origin={k: f"--tls-{k}" for k in given})
    files = tls_files(OmegaConf.load(config) if config else None)
    return files if files.ca or files.cert else None


def pick_run(client: redis.Redis, target: Target) -> Target:
    """Fill in prefix/run when not given: the only run with pools in this Redis."""
    if target.prefix and target.run:
        return target
    runs = [
        (p, r)
        for p, r in discover_runs(client)
        if (not target.prefix or p == target.prefix) and (not target.run or r == target.run)
    ]
    if len(runs) == 1:
        return Target(target.url, *runs[0], target.tls)
    if not runs and target.run:  # no pool has started yet: inspect what is there
        prefix = target.prefix or "nonstop"
        return Target(target.url, prefix, target.run, target.tls)
    listing = ", ".join(f"--prefix {p} --run {r}" for p, r in runs) or "none"
    raise ValueError(f"pass --run (and --prefix) to choose a run; runs with pools here: {listing}")
