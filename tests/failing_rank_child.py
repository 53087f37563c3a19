"""One CPU process of a job that tests/test_distributed.py ends on purpose:
rank 1 fails (``raise``, ``exit`` with status 3, or ``kill``) a second after
start-up, while rank 0 waits, in Python (``sleep``) or in native code
(``native``: a key-value read of jax.distributed that nobody answers).
"""

import os
import signal
import sys
import time

from jax_flashoverlap import distributed

distributed.initialize()

import jax  # noqa: E402  (after initialize, which must come first)

how, wait = sys.argv[1], sys.argv[2]
if jax.process_index() == 1:
    time.sleep(1.0)
    print(f"failing at {time.time():.3f}", flush=True)
    if how == "raise":
        raise RuntimeError("rank 1 gives up")
    if how == "exit":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    if wait == "sleep":
        time.sleep(60)
    else:
        distributed.check_same("never answered", {}, timeout_s=60)
finally:
    print("cleaned up", flush=True)
