"""``python -m pipedsl``: the same command line as the ``pipedsl`` script."""

from pipedsl.cli import main

raise SystemExit(main())
