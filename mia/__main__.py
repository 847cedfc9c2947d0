from mia.cli import main

raise SystemExit(main())
