"""``python -m ops.batch``: the same command as ``pagedq batch``, without the console script."""

import sys

from ops.batch.command import main

sys.exit(main())
