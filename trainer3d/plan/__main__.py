import sys

from trainer3d.plan.cli import main

sys.exit(main())
