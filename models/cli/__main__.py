"""`python -m models.cli`: the same as `jpa-sample` (:func:`models.cli.command.main`)."""
import sys

from models.cli.command import main

sys.exit(main())
