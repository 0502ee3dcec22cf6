"""``python -m wsseg``: the ``wsseg`` command."""
import sys

from wsseg.flows.cli import main

sys.exit(main())
