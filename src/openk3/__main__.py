"""``python -m openk3 …`` (what ``torchrun -m openk3 train …`` runs): the ``openk3`` command."""

import sys

from openk3.cli import main

sys.exit(main())
