"""`python -m engine.config`: engine/config/reference.py."""

import sys

from engine.config.reference import main

sys.exit(main())
