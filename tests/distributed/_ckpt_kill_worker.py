"""Worker of tests/test_checkpoint.py: in this one process, save the model of SEED to PATH, with a SIGKILL at
a point of the save. argv: PATH SEED WHEN, WHEN one of
  "after:SECONDS"   a timer kills the process that long into the save;
  "before_switch"   killed once every file is written, before the folder is switched in;
  "between"         killed between the two renames of the switch (the old folder moved aside, the new not yet in).
"""

from __future__ import annotations

import os
import signal
import sys
import threading


import autopar.checkpoint as ckpt
from tests.distributed._ckpt_models import model_and_optimizer


def kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(path: str, seed: int, when: str) -> None:
    model, opt = model_and_optimizer(seed)
    if when.startswith("after:"):
        threading.Timer(float(when.split(":")[1]), kill).start()
    elif when == "before_switch":
        ckpt._switch = lambda *args: kill()
    elif when == "between":
        real = os.replace

        def replace(src, dst):  # (os.replace is also the atomic writes' own: only the switch's first rename)
            real(src, dst)
            if ".old-" in os.path.basename(str(dst)):
                kill()

        os.replace = replace
    ckpt.save(model, opt, path)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
