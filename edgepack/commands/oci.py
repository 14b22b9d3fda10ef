"""`edgepack push` / `edgepack pull`: a model's artifacts as one multi-arch OCI image index in a registry."""
from __future__ import annotations

import json
from pathlib import Path

import click

from .common import log

_CREDS_HELP = """Credentials: EDGEPACK_REGISTRY_USER + EDGEPACK_REGISTRY_PASSWORD, else $REGISTRY_AUTH_FILE,
$XDG_RUNTIME_DIR/containers/auth.json, $DOCKER_CONFIG/config.json, ~/.docker/config.json (docker/podman
login); never on the command line. HTTPS unless --insecure-registry."""

insecure_option = click.option("--insecure-registry", "insecure", is_flag=True,
                               help="Talk plain HTTP to the registry (a lab registry; also needed for 127.0.0.1). "
                                    "Without it, HTTPS only.")


@click.command(epilog=_CREDS_HELP)
@click.argument("sources", nargs=-1, required=True, type=click.Path(path_type=Path), metavar="DIST_OR_ARTIFACT...")
@click.argument("reference", metavar="REGISTRY/REPO:TAG")
@insecure_option
@click.option("--json", "as_json", is_flag=True, help="Print what was pushed (digests, bytes) as JSON on stdout.")
def push(sources, reference, insecure, as_json):
    """Push one model's artifacts (one per target) to REGISTRY/REPO:TAG as one OCI image index.

    Each target becomes an OCI artifact with its platform (linux/amd64, linux/arm64/v8; Jetson and Android
    builds carry org.edgepack.target): the executable, its manifest JSON and SHA256SUMS as layers.
    Blobs the registry already has are not uploaded again.

    \b
    Examples:
      edgepack push dist/ registry.example:5000/models/tiny_cnn:1.0
      edgepack push dist/tiny_cnn-x86_64 dist/tiny_cnn-arm64 127.0.0.1:5000/tiny_cnn:dev --insecure-registry
    """
    from ..oci.push import push as do_push
    res = do_push(list(sources), reference, insecure=insecure, log=None if as_json else log)
    if as_json:
        click.echo(json.dumps(res.to_json(), indent=1))
        return
    for e in res.entries:
        click.echo(f"{e.target}\t{e.platform}\t{e.digest}")
    click.echo(f"pushed {res.reference}@{res.digest} ({len(res.entries)} platform(s); "
                      f"uploaded {res.stats.uploaded} blob(s), {res.stats.uploaded_bytes} bytes; "
                      f"{res.stats.skipped} already there) in {res.seconds:.2f} s")


@click.command(epilog=_CREDS_HELP)
@click.argument("reference", metavar="REGISTRY/REPO[:TAG|@DIGEST]")
@click.option("--platform", "platform_spec", metavar="OS/ARCH[/VARIANT]",
              help="Entry to fetch, e.g. linux/arm64 (default: this machine's platform).")
@click.option("--target", "target", metavar="NAME",
              help="Entry of this edgepack target (jetson-orin, android-arm64, ...), when several share a platform.")
@click.option("--output", "-o", "out_dir", type=click.Path(path_type=Path), required=True,
              help="Folder to write the artifact, its manifest JSON and SHA256SUMS into.")
@insecure_option
@click.option("--json", "as_json", is_flag=True, help="Print what was pulled as JSON on stdout.")
def pull(reference, platform_spec, target, out_dir, insecure, as_json):
    """Pull one platform's artifact from REFERENCE, verify every digest and sha256, write it into DIR.

    \b
    Examples:
      edgepack pull registry.example:5000/models/tiny_cnn:1.0 --platform linux/arm64 -o pulled/
      edgepack pull 127.0.0.1:5000/tiny_cnn:dev --target jetson-orin -o orin/ --insecure-registry
    """
    from ..oci.pull import pull as do_pull
    from ..oci.ref import parse_platform
    platform = parse_platform(platform_spec) if platform_spec else None
    res = do_pull(reference, out_dir, platform=platform, target=target, insecure=insecure)
    if as_json:
        click.echo(json.dumps(res.to_json(), indent=1))
        return
    for name, sha in sorted(res.files.items()):
        click.echo(f"{sha}  {out_dir / name}")
    click.echo(f"pulled {res.target} ({res.platform}) {res.digest} in {res.seconds:.2f} s")


COMMANDS = (push, pull)
