"""OCI registries: push a model's per-target artifacts as one image index, pull one platform back.

Layout of what is pushed: oci/layout.py; credentials: oci/credentials.py; the wire: oci/client.py.
"""
from __future__ import annotations

from .pull import PullResult, pull
from .push import PushResult, push
from .ref import Platform, Reference, looks_like_reference, parse_platform, parse_reference

__all__ = ["Platform", "PullResult", "PushResult", "Reference", "looks_like_reference", "parse_platform",
           "parse_reference", "pull", "push"]
