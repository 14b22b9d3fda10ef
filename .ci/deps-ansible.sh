#!/usr/bin/env bash
# Machine set-up for the Ansible path (`edgepack deploy --via ansible`, `edgepack fleet export-ansible`,
# tests/test_ansible.py): idempotent, run by scripts/setup.sh / .ci/run after `pip install -e .`.
#   ansible-core    ansible-playbook / ansible-inventory, pinned from the registry of Python packages into
#                   "$PYTHON" (not Debian's 2.14): the same version in a virtual environment as on the
#                   system, next to ansible-runner; 2.18 is the newest that runs on Python 3.11 and still
#                   manages devices with Python 3.8 (Debian 11 / L4T r35 era)
#   ansible-runner  runs the playbook from edgepack and hands over its events (per-device results)
#   openssh-client  Ansible's ssh connection (ssh, sftp/scp), with ControlMaster
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=.ci/lib.sh
source .ci/lib.sh  # after the cd above: paths are from the repository root
apt_install openssh-client
"$PYTHON" -m pip install "ansible-core==2.18.19" "ansible-runner==2.4.3"
