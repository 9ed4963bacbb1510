import sys

from trainer3d.zero.engine import main

sys.exit(main())
