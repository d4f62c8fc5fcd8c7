import sys

from tokenfeed.cli import main

sys.exit(main())
