import sys

from rlkit.cli import main

sys.exit(main())
