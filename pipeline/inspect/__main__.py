import sys

from pipeline.inspect.cli import main

sys.exit(main())
