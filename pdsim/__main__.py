"""`python -m pdsim`: the pdsim command line."""

import sys

from pdsim.cli import main

sys.exit(main())
