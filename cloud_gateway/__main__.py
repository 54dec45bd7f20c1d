from __future__ import annotations

import sys

from cloud_gateway.cli import main

sys.exit(main())
