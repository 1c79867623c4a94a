"""``python -m astrai.data``: see :mod:`astrai.data.pipeline`."""

import sys

from astrai.data.pipeline import main

sys.exit(main())
