"""``python -m streamwin``: the ``streamwin`` command (as ``python -m streamwin.cli``)."""
import sys

from streamwin.cli.main import main

sys.exit(main())
