from __future__ import annotations

import sys

from edge_agent.cli import main

sys.exit(main())
