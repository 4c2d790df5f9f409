"""Driver for the atomic-save test: run ``evenpipe train ARGS`` as the only rank of a world in this process, and
kill this process with SIGKILL inside its second checkpoint save -- after every data file is written, before the
save completes (DCP's metadata, the rename, the ``latest`` pointer).

Usage: ``python kill_mid_save.py PORT ARGS...``
"""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed.checkpoint import filesystem

_real_finish = filesystem.FileSystemWriter.finish
_saves = [0]


def _finish(self, metadata, results):  # type: ignore[no-untyped-def]
    _saves[0] += 1
    if _saves[0] == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return _real_finish(self, metadata, results)


if __name__ == "__main__":
    filesystem.FileSystemWriter.finish = _finish  # type: ignore[method-assign]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    from evenpipe.cli import main
    sys.exit(main(["train", *sys.argv[2:]]))
