import sys

from raytrain_ext.cli import main

sys.exit(main())
