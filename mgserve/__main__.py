from mgserve.cli import main

raise SystemExit(main())
