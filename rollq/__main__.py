import sys

from rollq.cli import main

sys.exit(main())
