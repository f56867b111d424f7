import sys

from pdref.cli import main

sys.exit(main())
