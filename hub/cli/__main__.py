"""`python -m echo2p2p.hub.cli`: the same as `echo2-hub`."""

from . import main

raise SystemExit(main())
