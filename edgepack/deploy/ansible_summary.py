"""Ansible callback plugin written as callback_plugins/edgepack_summary.py next to an exported playbook:
one result line per device at the end of the run, including the devices the failure threshold kept
untouched and the unreachable ones (Ansible's own recap only counts tasks). Imports nothing from edgepack.
"""
from __future__ import annotations

import importlib
import json

# imported by name at run time: edgepack only reads this file (to write it next to a playbook), and a
# static import would make the one-file freezer bundle all of Ansible
CallbackBase = importlib.import_module("ansible.plugins.callback").CallbackBase

DOCUMENTATION = """
name: edgepack_summary
type: aggregate
short_description: one edgepack result line per device
description:
  - prints one line (edgepack, device, status, seconds, message) for every device of the play
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "edgepack_summary"
    CALLBACK_NEEDS_ENABLED = False

    def __init__(self):
        super().__init__()
        self.hosts: list[str] = []
        self.results: dict[str, dict] = {}

    def v2_playbook_on_play_start(self, play):
        inventory = play.get_variable_manager()._inventory
        # every device of the play, not only this batch's: the untouched ones get a line too
        for h in inventory.get_hosts(play.hosts, ignore_restrictions=True):
            if h.name not in self.hosts:
                self.hosts.append(h.name)

    def v2_runner_on_ok(self, result, **kwargs):
        if result._task.get_name() == "edgepack result":
            try:
                self.results[result._host.get_name()] = json.loads(result._result.get("msg", ""))
            except (TypeError, ValueError):
                pass

    def v2_runner_on_unreachable(self, result, **kwargs):
        msg = str(result._result.get("msg", "")).strip().splitlines()
        self.results.setdefault(result._host.get_name(), {"status": "unreachable",
                                                          "message": msg[-1] if msg else "unreachable"})

    def v2_playbook_on_stats(self, stats):
        for host in self.hosts:
            r = self.results.get(host, {"status": "skipped",
                                        "message": "not started: the roll-out stopped at the failure threshold"})
            secs = f" ({float(r['seconds']):.1f} s)" if r.get("seconds") is not None else ""
            self._display.display(f"edgepack: {host} {r.get('status', '?')}{secs} {r.get('message', '')}".rstrip())
