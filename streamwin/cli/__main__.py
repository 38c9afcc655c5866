"""``python -m streamwin.cli``: the ``streamwin`` command."""
import sys

from streamwin.cli.main import main

sys.exit(main())
