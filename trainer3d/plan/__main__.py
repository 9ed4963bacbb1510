import sys

from trainer3d.plan.search import main

sys.exit(main())
