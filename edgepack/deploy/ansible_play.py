"""The controller half of the Ansible roll-out: the playbook and its two small plugins, written next to
it by `edgepack fleet export-ansible` (self-contained: running it needs Ansible, not edgepack).

The play works in canary batches (`serial`), stops the roll-out past `max_fail_percentage`, and per
device: detects Python >= 3.8 with `raw` (without it only `raw`/`script` are used), probes (architecture,
glibc, free space, installed version: identical means no change), takes DEST/.edgepack-lock, uploads to
releases/.incoming-*, verifies the sha256 on the device, moves it to releases/<sha16>, runs the selftest
there, and only then switches previous/current; a failure in between is handled in `rescue` (the new
release is removed, `current` never moved). Every device ends with one `edgepack result` line (JSON).
"""
from __future__ import annotations

PLAYBOOK = r"""# Written by `edgepack fleet export-ansible`: deploys @@NAME@@ (sha256 @@SHA@@)
# with the steps of `edgepack deploy` (see docs/deploy.md). Run here: ansible-playbook site.yml
- name: edgepack deploy @@NAME@@
  hosts: edgepack
  gather_facts: false
  serial: @@SERIAL@@
  max_fail_percentage: @@MAXFAIL@@
  vars_files: [edgepack.yml]
  tasks:
    - name: edgepack deploy
      block:
        - name: start
          ansible.builtin.set_fact:
            ep_t0: "{{ now().timestamp() }}"
            ep_token: "{{ lookup('ansible.builtin.password', '/dev/null', chars=['digits', 'abcdef'], length=16) }}"
            ep_locked: false
            ep_raw: true
            ep_p: {}
            ep_result: {}
        - name: Python >= 3.8 on the device? (raw needs none)
          ansible.builtin.raw: >-
            p=$(command -v python3) && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 8))'
            && echo "@python $p" || echo '@python none'
          register: ep_py
          changed_when: false
        - name: probe (architecture, glibc, free space, installed version)
          ansible.builtin.script:
            cmd: "edgepack-step.sh probe {{ edgepack_dest | quote }}"
            executable: sh
          register: ep_probe
          changed_when: false
        - name: read the probe (without Python only raw and script modules are used)
          ansible.builtin.set_fact:
            ep_p: "{{ ep_probe.stdout | edgepack_parse }}"
            ep_raw: "{{ (ep_py.stdout | edgepack_parse).python | default('none') == 'none' }}"
            ansible_python_interpreter: "{{ (ep_py.stdout | edgepack_parse).python | default('python3') }}"
        - name: the artifact fits the device
          ansible.builtin.fail:
            msg: "{{ ep_p.refuse }}"
          when: ep_p.refuse is defined
        - name: install unless this version is current
          when: ep_p.current_sha | default('') != edgepack_sha256
          block:
            - name: take the device's lock
              ansible.builtin.script:
                cmd: "edgepack-step.sh lock {{ edgepack_dest | quote }} {{ ep_token }} 0 {{ edgepack_lock_stale }} {{ inventory_hostname | edgepack_owner(ep_token, 'deploy') | map('quote') | join(' ') }}"
                executable: sh
              register: ep_lock1
              changed_when: false
            - name: take over a lock whose edgepack run on this machine has ended
              ansible.builtin.script:
                cmd: "edgepack-step.sh takeover {{ edgepack_dest | quote }} {{ (ep_lock1.stdout | edgepack_parse).owner_token | default('-') | quote }}"
                executable: sh
              when: "'@locked' not in ep_lock1.stdout and (ep_lock1.stdout | edgepack_lock_stale(edgepack_lock_stale))"
              changed_when: false
            - name: wait for the lock
              ansible.builtin.script:
                cmd: "edgepack-step.sh lock {{ edgepack_dest | quote }} {{ ep_token }} {{ edgepack_lock_wait }} {{ edgepack_lock_stale }} {{ inventory_hostname | edgepack_owner(ep_token, 'deploy') | map('quote') | join(' ') }}"
                executable: sh
              register: ep_lock2
              changed_when: false
              when: "'@locked' not in ep_lock1.stdout"
            - name: locked?
              ansible.builtin.set_fact:
                ep_locked: "{{ '@locked' in ep_lock1.stdout or '@locked' in (ep_lock2.stdout | default('')) }}"
                # the lock step left a copy of the step script in the lock folder: the next steps are one
                # `raw` command each instead of a `script` upload each
                ep_step: "{{ ep_p.dest }}/.edgepack-lock/step.sh"
            - name: another run holds the lock
              ansible.builtin.fail:
                msg: "{{ ep_p.dest }} is locked by another edgepack run ({{ ep_lock2.stdout | default('') | edgepack_holder }}); waited {{ edgepack_lock_wait }} s, nothing was changed"
              when: not ep_locked
            - name: look again under the lock
              ansible.builtin.raw: "sh {{ ep_step | quote }} probe {{ ep_p.dest | quote }}"
              register: ep_probe
              changed_when: false
            - name: read it
              ansible.builtin.set_fact:
                ep_p: "{{ ep_probe.stdout | edgepack_parse }}"
            - name: upload, verify on the device, selftest, switch
              when: ep_p.current_sha | default('') != edgepack_sha256
              block:
                - name: upload folder (if there is room)
                  ansible.builtin.raw: "sh {{ ep_step | quote }} prepare {{ ep_p.dest | quote }} .incoming-{{ ep_token }} {{ edgepack_need_kb }}"
                  register: ep_prep
                  when: ep_p.have_release is not defined
                - name: upload (copy, with the device's Python)
                  ansible.builtin.copy:
                    src: "files/{{ edgepack_artifact }}"
                    dest: "{{ (ep_prep.stdout | edgepack_parse).incoming }}/{{ edgepack_artifact }}"
                    mode: "0755"
                  when: ep_p.have_release is not defined and not ep_raw
                - name: upload (script, for a device without Python)
                  ansible.builtin.script:
                    cmd: "files/{{ edgepack_artifact }}.run {{ (ep_prep.stdout | edgepack_parse).incoming | quote }}"
                    executable: sh
                  when: ep_p.have_release is not defined and ep_raw
                - name: verify the sha256 on the device, move into releases/<sha16>
                  ansible.builtin.raw: "sh {{ ep_step | quote }} install {{ ep_p.dest | quote }} .incoming-{{ ep_token }}"
                  when: ep_p.have_release is not defined
                - name: selftest on the device, before anything points at it
                  ansible.builtin.raw: "sh {{ ep_step | quote }} selftest {{ ep_p.dest | quote }} {{ edgepack_selftest_timeout }}"
                  register: ep_st
                  changed_when: false
                  failed_when: not (ep_st.stdout | default('') | edgepack_selftest(edgepack_selftest_timeout)).passed
                  timeout: "{{ edgepack_selftest_timeout + 30 }}"
                - name: switch (atomic renames) and prune
                  ansible.builtin.raw: "sh {{ ep_step | quote }} switch {{ ep_p.dest | quote }}"
                  register: ep_sw
                - name: deployed
                  ansible.builtin.set_fact:
                    ep_result:
                      status: deployed
                      message: "{{ edgepack_short[:8] }} installed{{ (', previous ' ~ ep_p.current[-16:][:8] ~ ' kept') if ep_p.current is defined else '' }}"
                      latency_ms: "{{ (ep_st.stdout | edgepack_selftest).latency_ms }}"
                      sha256: "{{ edgepack_sha256 }}"
        - name: no change
          ansible.builtin.set_fact:
            ep_result:
              status: no change
              message: "{{ edgepack_short[:8] }} is already current"
              sha256: "{{ edgepack_sha256 }}"
          when: not ep_result
      rescue:
        - name: which step failed
          ansible.builtin.set_fact:
            ep_stage: "{{ 'selftest' if ansible_failed_task.name == 'selftest on the device, before anything points at it' else 'other' }}"
            ep_test: "{{ ep_st.stdout | default('@rc -1') | edgepack_selftest(edgepack_selftest_timeout) }}"
        - name: remove what this run uploaded (current never moved)
          ansible.builtin.raw: "sh {{ ep_step | quote }} discard {{ ep_p.dest | quote }}"
          when: ep_locked | bool
          ignore_errors: true
        - name: rolled back or failed
          ansible.builtin.set_fact:
            ep_result:
              status: "{{ 'rolled back' if ep_stage == 'selftest' else 'failed' }}"
              message: "{{ (ep_test.message if ep_stage == 'selftest' and ep_test is defined else ansible_failed_result | edgepack_failure) ~ ('; ' ~ (('back to ' ~ ep_p.current[-16:][:8]) if ep_p.current is defined else 'nothing was installed before') if ep_stage == 'selftest' else '') }}"
              output: "{{ ep_test.output | default('') if ep_stage == 'selftest' else '' }}"
              latency_ms: "{{ ep_test.latency_ms | default(none) if ep_stage == 'selftest' else none }}"
              sha256: "{{ ep_p.current_sha | default(none) }}"
              hint: "{{ ep_test.hint | default('') if ep_stage == 'selftest' else '' }}"
        - name: the device failed
          ansible.builtin.fail:
            msg: "{{ ep_result.message }}"
      always:
        - name: release the lock
          ansible.builtin.raw: "sh {{ ep_step | quote }} unlock {{ ep_p.dest | quote }} {{ ep_token }}"
          when: ep_locked | bool
          changed_when: false
          ignore_errors: true
        - name: edgepack result
          ansible.builtin.debug:
            msg: "{{ ep_result | combine({'device': inventory_hostname, 'raw': ep_raw, 'arch': ep_p.arch | default(none), 'emulates': ep_p.emulates | default(''), 'glibc': ep_p.glibc | default(none), 'dest': ep_p.dest | default(none), 'seconds': ((now().timestamp() - (ep_t0 | float)) | round(3))}) | to_json }}"
"""
