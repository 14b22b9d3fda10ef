"""Registry references (``host[:port]/repo[:tag|@sha256:...]``) and OCI platforms for edgepack targets."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UsageError

# The distribution spec's grammar, restricted to what a registry host must look like: edgepack never
# guesses a default registry (a bare "repo:tag" would silently go to a public one).
_HOST = r"(?P<host>localhost(?::\d+)?|\[[0-9a-fA-F:]+\](?::\d+)?|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*(?::\d+)?)"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REF_RE = re.compile(rf"^{_HOST}/(?P<repo>{_COMPONENT}(?:/{_COMPONENT})*)"
                     r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$")

_EXAMPLE = "registry.example:5000/models/tiny_cnn:1.0"


@dataclass(frozen=True)
class Reference:
    registry: str        # host[:port]
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def reference(self) -> str:
        """What goes after /manifests/: the digest when pinned, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}" + (f":{self.tag}" if self.tag else "") + \
            (f"@{self.digest}" if self.digest else "")


def looks_like_reference(text: str) -> bool:
    """True for ``host:port/...`` or ``host.domain/...`` (a path on disk rarely looks like that)."""
    m = _REF_RE.match(text)
    return bool(m) and ("." in m["host"] or ":" in m["host"] or m["host"] == "localhost")


def parse_reference(text: str, *, need_tag: bool = False) -> Reference:
    m = _REF_RE.match(text.strip())
    if not m or not ("." in m["host"] or ":" in m["host"] or m["host"].startswith("localhost")):
        raise UsageError(f"invalid registry reference {text!r}",
                         hint=f"write REGISTRY[:PORT]/REPOSITORY[:TAG], e.g. {_EXAMPLE} (lower-case repository; "
                              "the registry host is never guessed)")
    if need_tag and not m["tag"]:
        raise UsageError(f"registry reference {text!r} has no tag", hint=f"push to a tag, e.g. {_EXAMPLE}")
    if need_tag and m["digest"]:
        raise UsageError(f"cannot push to a digest ({text!r})", hint=f"push to a tag, e.g. {_EXAMPLE}")
    return Reference(m["host"], m["repo"], m["tag"], m["digest"])


@dataclass(frozen=True)
class Platform:
    os: str
    architecture: str
    variant: str | None = None

    def to_json(self) -> dict:
        return {"os": self.os, "architecture": self.architecture, **({"variant": self.variant} if self.variant else {})}

    def __str__(self) -> str:
        return f"{self.os}/{self.architecture}" + (f"/{self.variant}" if self.variant else "")

    def matches(self, other: "Platform") -> bool:
        """``other`` (what was asked) without a variant matches any variant, as `docker pull --platform`."""
        return self.os == other.os and self.architecture == other.architecture and \
            (other.variant is None or other.variant == self.variant)


# ELF/uname arch -> OCI (GOARCH) names; 64-bit Arm is always v8 for the OCI image spec.
_OCI_ARCH = {"x86_64": ("amd64", None), "aarch64": ("arm64", "v8"), "arm": ("arm", "v7")}
_ALIASES = {"x86_64": "amd64", "x86-64": "amd64", "aarch64": "arm64", "armhf": "arm"}


def platform_for_arch(arch: str) -> Platform:
    """The platform of an artifact (or device) of ``arch`` (x86_64 | aarch64 | arm). Every edgepack artifact
    is a static Linux executable, so Android and Jetson builds are linux/arm64/v8 too: the entry's
    ``org.edgepack.target`` annotation tells them apart."""
    if arch not in _OCI_ARCH:
        raise UsageError(f"no OCI platform for architecture {arch!r}")
    name, variant = _OCI_ARCH[arch]
    return Platform("linux", name, variant)


def parse_platform(text: str) -> Platform:
    parts = text.strip().split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise UsageError(f"invalid platform {text!r}", hint="write OS/ARCH[/VARIANT], e.g. linux/arm64 or linux/amd64")
    arch = _ALIASES.get(parts[1], parts[1])
    return Platform(parts[0], arch, parts[2] if len(parts) == 3 else None)
