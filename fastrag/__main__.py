import sys

from fastrag.cli import main

sys.exit(main())
