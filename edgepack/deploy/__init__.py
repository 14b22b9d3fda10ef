"""SSH deployment of artifacts to devices (issue #4: edgepack deploy).

Modules, in the order a deploy uses them:
  device     - the Device record and `user@host[:port]` parsing
  inventory  - devices.toml and ~/.ssh/config aliases -> Device records
  artifact   - what is being pushed: sha256, target, arch, glibc baseline
  connector  - the interface every transport implements (run a command, file operations)
  ssh        - the paramiko connector, with known_hosts verification
  local      - the same interface on this machine (like pyinfra's @local)
  probe      - facts about a device (arch, glibc, free space, installed version) and the target check
  release    - the on-device layout DEST/releases/<sha>/ + `current`/`previous` links, switch and rollback
  selftest   - running and parsing the artifact's selftest/bench on the device
  engine     - deploy/check/smoke/rollback for one device, and bounded parallelism over many
  results    - the per-device result record, table and JSON
"""
