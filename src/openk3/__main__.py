"""``python -m openk3 …`` (what ``torchrun -m openk3 train …`` and ``openk3 train --nproc-per-node`` run): the
``openk3`` command.

A rank under torch's elastic agent that stopped on bad input (exit status 2, the error already in its error
file) has nothing to save and leaves at once (``os._exit``): at a normal interpreter exit a C++ destructor of
a still-running torch.distributed thread can abort the process ("terminate called without an active
exception", SIGABRT), which turned bad input into a rank failure with a stray line.
"""

import os
import sys

from openk3.cli import main

code = main()
if code == 2 and "TORCHELASTIC_RUN_ID" in os.environ:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
