import sys

from tieredkv.cli import main

sys.exit(main())
