"""`python -m echo2p2p.hub.conformance`: check a peer implementation against the protocol."""

from . import main

raise SystemExit(main())
