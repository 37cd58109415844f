"""`python -m deployrl ...` is the `deployrl` command (and what `torchrun -m deployrl` runs)."""

from deployrl.cli import main

raise SystemExit(main())
