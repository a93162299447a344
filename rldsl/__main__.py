import sys

from rldsl.cli import main

sys.exit(main())
