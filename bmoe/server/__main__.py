"""`python -m bmoe.server`: the same as `bmoe-server`."""

import sys

from bmoe.server.main import main

sys.exit(main())
