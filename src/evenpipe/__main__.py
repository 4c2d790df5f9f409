import sys

from evenpipe.cli import main

sys.exit(main())
