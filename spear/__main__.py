import sys

from spear.cli import main

sys.exit(main())
