#!/usr/bin/env bash
# Machine set-up for the OCI registry path (edgepack push/pull, deploy from a registry; tests/test_oci.py):
# idempotent, run as root on a fresh Debian 12 by scripts/setup.sh / .ci/run after `apt-get update`.
#   docker-registry  the CNCF distribution registry; tests start their own on 127.0.0.1 with their own
#                    config and storage (the system service is never used)
#   skopeo           a second, independent OCI client that reads what edgepack pushed
#   apache2-utils    htpasswd (bcrypt) for the registry's basic-auth variant
#   oras (PyPI)      the OCI client library edgepack pushes and pulls with
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=.ci/lib.sh
source .ci/lib.sh  # after the cd above: paths are from the repository root
apt_install docker-registry skopeo apache2-utils
"$PYTHON" -m pip install "oras==0.2.43"
