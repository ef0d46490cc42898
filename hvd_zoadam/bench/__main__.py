"""``python -m hvd_zoadam.bench ...``: see :mod:`hvd_zoadam.bench.cli`."""
import sys

from hvd_zoadam.bench.cli import main

sys.exit(main())
