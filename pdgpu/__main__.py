"""`python -m pdgpu`: the engine command line."""

import sys

from pdgpu.cli import main

sys.exit(main())
