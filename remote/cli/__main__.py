import sys

from remote.cli.main import main

sys.exit(main())
