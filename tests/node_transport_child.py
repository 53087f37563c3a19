"""One CPU process of a job run by tests/test_node_transport.py through the
launcher: node_transport.setup() with a fake extension, which records what it
is asked to do. Prints ``key=value`` lines.

    node_transport_child.py exchange|missing|workspace|several
"""

import json
import sys

from jax_flashoverlap import distributed

distributed.initialize()

import jax  # noqa: E402  (after initialize, which must come first)

if sys.argv[1] == "several":  # two devices in each process
    jax.config.update("jax_num_cpu_devices", 2)

from jax_flashoverlap import node_transport  # noqa: E402


class FakeExtension:
    """Hands out a handle naming the device, and records every call."""

    def __init__(self):
        self.calls = []

    def configure_node(self, node_size, local, labels):
        self.calls.append(["configure", node_size, [list(p) for p in local], labels])

    def export_workspace(self, id):  # noqa: A002 - the extension's name
        self.calls.append(["export", id])
        return f"handle of {id}".encode(), 1 << 30

    def import_workspace(self, id, handle, bytes):  # noqa: A002
        self.calls.append(["import", id, handle.decode(), bytes])


mode = sys.argv[1]
me = jax.process_index()
fake = FakeExtension()
try:
    if mode == "missing" and me == 1:
        print("skipped=1")  # never reaches the set-up
    else:
        layout = node_transport.setup(backend=fake, timeout_s=30 if mode != "missing" else 2,
                                      workspace_mb=1024 + (me if mode == "workspace" else 0))
        print("layout=" + json.dumps({"ids": sorted(layout.ids.values()),
                                      "node_size": layout.node_size,
                                      "labels": list(layout.labels),
                                      "spans": layout.spans_processes(),
                                      "local_only": layout.local_only,
                                      "again": node_transport.setup(backend=fake) is layout}))
except (RuntimeError, ValueError) as e:
    print(f"error={type(e).__name__}: {e}")
print("calls=" + json.dumps(fake.calls))
