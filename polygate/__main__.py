"""``python -m polygate …`` runs the command line (same as the ``polygate`` script)."""

from polygate.cli import main

raise SystemExit(main())
