import sys

from kvstate.cli import main

sys.exit(main())
