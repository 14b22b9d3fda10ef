"""One repository on one OCI registry: blobs through the ``oras`` library, manifests and the index as
exact bytes over oras's own session (oras re-serialises manifests, so their digests would not be ours).

Every failure becomes one edgepack error: unreachable / plain HTTP refused / protocol -> RegistryError,
credentials -> RegistryAuthError, a missing repository or tag -> RegistryNotFound.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import requests

from ..errors import RegistryAuthError, RegistryError, RegistryNotFound
from .credentials import Credentials, find_credentials
from .ref import Reference

INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_ACCEPT = f"{INDEX}, {MANIFEST}"


def _insecure_hint(registry: str) -> str:
    return f"if {registry} really serves plain HTTP (a lab registry), pass --insecure-registry"


@dataclass
class Stats:
    """What one push or pull moved: a second push of the same thing uploads nothing."""
    uploaded: int = 0
    uploaded_bytes: int = 0
    skipped: int = 0
    downloaded_bytes: int = 0


def _oras_registry(registry: str, insecure: bool, bearer: bool, timeout: float):
    import oras.provider

    one_try = oras.provider.Registry.do_request.__wrapped__

    class _Registry(oras.provider.Registry):
        def do_request(self, *args, **kwargs):
            # one try: oras's own retry sleeps up to ~2 minutes on a dead registry; the caller reports instead
            return one_try(self, *args, **kwargs)

    reg = _Registry(hostname=registry, insecure=insecure, auth_backend="token" if bearer else "basic")
    # requests has no session-wide timeout: bound every call (a silent registry must not hang a deploy)
    reg.session.request = functools.partial(reg.session.request, timeout=timeout)
    return reg


class RegistryClient:
    def __init__(self, ref: Reference, *, insecure: bool = False, timeout: float = 60.0,
                 credentials: Credentials | None = None):
        self.ref, self.insecure, self.timeout = ref, insecure, timeout
        self.scheme = "http" if insecure else "https"
        self.base = f"{self.scheme}://{ref.registry}/v2/{ref.repository}"
        self.creds = credentials if credentials is not None else find_credentials(ref.registry)
        self.stats = Stats()
        bearer = self._ping()
        self.oras = _oras_registry(ref.registry, insecure, bearer, timeout)
        if self.creds:
            self.oras.auth.set_basic_auth(self.creds.username, self.creds.password)
            if not bearer:  # send basic auth up front: no 401 round trip per request
                self.oras.session.auth = (self.creds.username, self.creds.password)
        self.container = self.oras.get_container(f"{ref.registry}/{ref.repository}:{ref.tag or 'latest'}")

    # -- connection and credentials -------------------------------------------------------------
    def _ping(self) -> bool:
        """GET /v2/ once: reachable, speaks this scheme, and our credentials (if any) work. Returns
        whether the registry uses bearer tokens (then oras's token flow takes the credentials)."""
        url = f"{self.scheme}://{self.ref.registry}/v2/"
        r = self._raw("GET", url)
        if r.status_code == 401:
            challenge = r.headers.get("WWW-Authenticate", "")
            if challenge.lower().startswith("bearer") and not self.creds:
                return True  # token registries answer 401 here even to anonymous pulls: oras asks for a token
            if not self.creds:
                raise RegistryAuthError(f"{self.ref.registry} requires credentials and none were found",
                                        hint="set EDGEPACK_REGISTRY_USER and EDGEPACK_REGISTRY_PASSWORD, or log in "
                                             "with docker/podman login (~/.docker/config.json, $REGISTRY_AUTH_FILE)")
            if challenge.lower().startswith("bearer"):
                return True
            r = self._raw("GET", url, auth=(self.creds.username, self.creds.password))
            if r.status_code in (401, 403):
                raise RegistryAuthError(f"{self.ref.registry} refused the credentials of user "
                                        f"{self.creds.username!r} (from {self.creds.source})",
                                        hint="check the user and password, or log in again")
        if r.status_code >= 400:
            raise RegistryError(f"{self.ref.registry} answered HTTP {r.status_code} to /v2/: not an OCI registry?")
        return False

    def _raw(self, method: str, url: str, **kw) -> requests.Response:
        try:
            return requests.request(method, url, timeout=min(self.timeout, 15.0), **kw)
        except requests.exceptions.SSLError as exc:
            plain = "wrong version number" in str(exc).lower() or "record layer" in str(exc).lower()
            raise RegistryError(f"{self.ref.registry}: HTTPS failed ({'the registry speaks plain HTTP' if plain else 'TLS error'})",
                                hint=_insecure_hint(self.ref.registry) if plain else
                                "fix the registry's certificate, or trust its CA (REQUESTS_CA_BUNDLE)") from None
        except requests.exceptions.RequestException as exc:
            raise RegistryError(f"cannot reach registry {self.ref.registry} over {self.scheme.upper()}: "
                                f"{type(exc).__name__}",
                                hint="check the host and port, and that the registry is running") from None

    def _do(self, method: str, url: str, **kw) -> requests.Response:
        try:
            r = self.oras.do_request(url, method, **kw)
        except requests.exceptions.RequestException as exc:
            raise RegistryError(f"{self.ref.registry}: {method} failed ({type(exc).__name__})",
                                hint="check that the registry is still running, then retry") from None
        except ValueError as exc:  # oras: "Cannot respond to request for authentication."
            raise RegistryAuthError(f"{self.ref.registry}: {exc}") from None
        if r.status_code in (401, 403):
            raise RegistryAuthError(f"{self.ref.registry} refused {method} {self.ref.repository} "
                                    f"(HTTP {r.status_code}) for " + (f"user {self.creds.username!r}" if self.creds
                                                                     else "anonymous access"),
                                    hint="check the user's rights on this repository")
        return r

    def _check(self, r: requests.Response, what: str) -> requests.Response:
        if r.status_code == 404:
            raise RegistryNotFound(f"{what} not found in {self.ref.registry}/{self.ref.repository}",
                                   hint="check the repository and tag (skopeo list-tags docker://REGISTRY/REPO)")
        if r.status_code >= 300:
            detail = ""
            try:
                detail = "; ".join(e.get("message", "") for e in r.json().get("errors", []))
            except (ValueError, AttributeError):
                pass
            raise RegistryError(f"{self.ref.registry}: {what}: HTTP {r.status_code}" + (f" ({detail})" if detail else ""))
        return r

    # -- blobs ---------------------------------------------------------------------------------
    def put_blob(self, path: Path | None, data: bytes | None, media_type: str) -> dict:
        """Upload unless the registry already has it (HEAD first); returns the descriptor."""
        import tempfile
        payload = data if data is not None else Path(path).read_bytes()
        desc = {"mediaType": media_type, "digest": "sha256:" + hashlib.sha256(payload).hexdigest(),
                "size": len(payload)}
        if self.oras.blob_exists(desc, self.container):
            self.stats.skipped += 1
            return desc
        with tempfile.TemporaryDirectory(prefix="edgepack-blob-") as tmp:
            if path is None:
                path = Path(tmp) / "blob"
                path.write_bytes(payload)
            try:
                r = self.oras.upload_blob(str(path), self.container, desc)
            except requests.exceptions.RequestException as exc:
                raise RegistryError(f"{self.ref.registry}: uploading {desc['digest'][:19]} failed "
                                    f"({type(exc).__name__})") from None
            except ValueError as exc:
                raise RegistryError(f"{self.ref.registry}: uploading {desc['digest'][:19]} failed ({exc})") from None
        self._check(r, f"blob upload {desc['digest'][:19]}")
        self.stats.uploaded += 1
        self.stats.uploaded_bytes += desc["size"]
        return desc

    def get_blob(self, digest: str, out: Path) -> None:
        url = f"{self.base}/blobs/{digest}"
        r = self._check(self._do("GET", url, stream=True), f"blob {digest[:19]}")
        with open(out, "wb") as fh:
            for chunk in r.iter_content(1 << 20):
                fh.write(chunk)
                self.stats.downloaded_bytes += len(chunk)

    # -- manifests -----------------------------------------------------------------------------
    def manifest_digest(self, reference: str) -> str | None:
        r = self._do("HEAD", f"{self.base}/manifests/{reference}", headers={"Accept": _ACCEPT})
        if r.status_code == 404:
            return None
        self._check(r, f"manifest {reference}")
        return r.headers.get("Docker-Content-Digest")

    def put_manifest(self, body: bytes, media_type: str, reference: str | None = None) -> str:
        """PUT exact bytes (by digest, or to a tag); skipped when the registry already holds them."""
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        ref = reference or digest
        if self.manifest_digest(ref) == digest:
            self.stats.skipped += 1
            return digest
        r = self._do("PUT", f"{self.base}/manifests/{ref}", data=body, headers={"Content-Type": media_type})
        self._check(r, f"manifest upload {ref}")
        self.stats.uploaded += 1
        self.stats.uploaded_bytes += len(body)
        return digest

    def get_manifest(self, reference: str) -> tuple[bytes, str, str]:
        """(bytes, media type, digest) of a manifest or index; the digest is checked when pinned."""
        r = self._check(self._do("GET", f"{self.base}/manifests/{reference}", headers={"Accept": _ACCEPT}),
                        f"{'manifest' if reference.startswith('sha256:') else 'tag'} {reference}")
        body = r.content
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        media = r.headers.get("Content-Type", "").split(";")[0].strip()
        return body, media, digest
