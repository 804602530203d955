"""``python -m supervisor.cli``: the same as the ``spanvisor`` command."""

import sys

from supervisor.cli.verbs import main

sys.exit(main())
